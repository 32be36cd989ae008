-- The scored trajectories canary '{canary_id}' routed: every call of the trajectory carries the
-- canary, one arm and one deployment; the latest reward wins. Run over landing tables pinned to one
-- Delta version each.
WITH scored AS (
    SELECT trajectory_id, reward
    FROM (
        SELECT trajectory_id, reward,
               row_number() OVER (PARTITION BY trajectory_id ORDER BY received_at DESC, feedback_id DESC) AS rn
        FROM landing_feedback
    ) latest
    WHERE rn = 1
), routed AS (
    SELECT trajectory_id,
           min(arm) AS arm,
           min(deployment_id) AS deployment_id,
           count(DISTINCT arm) AS n_arms,
           count(DISTINCT deployment_id) AS n_deployments,
           count(*) AS n_calls,
           sum(CASE WHEN canary_id = '{canary_id}' THEN 1 ELSE 0 END) AS n_routed
    FROM landing_calls
    WHERE trajectory_id IN (SELECT trajectory_id FROM landing_calls WHERE canary_id = '{canary_id}')
    GROUP BY trajectory_id
)
SELECT r.trajectory_id, r.arm, r.deployment_id, f.reward
FROM routed r
JOIN scored f ON f.trajectory_id = r.trajectory_id
WHERE r.n_routed = r.n_calls AND r.n_arms = 1 AND r.n_deployments = 1
ORDER BY r.trajectory_id
