-- The scored production trajectories a round trains on: served entirely by deployment
-- '{deployment_id}', rewarded (latest feedback wins), not yet taken by another round; the
-- earliest {limit} by first call. Run over landing tables pinned to one Delta version each.
WITH scored AS (
    SELECT trajectory_id, reward
    FROM (
        SELECT trajectory_id, reward,
               row_number() OVER (PARTITION BY trajectory_id ORDER BY received_at DESC, feedback_id DESC) AS rn
        FROM landing_feedback
    ) latest
    WHERE rn = 1
), served AS (
    SELECT trajectory_id,
           min(deployment_id) AS deployment_id,
           count(DISTINCT deployment_id) AS n_deployments,
           count(*) AS n_calls,
           sum(array_length(completion_token_ids)) AS n_completion_tokens,
           min(created_at) AS started_at,
           max(created_at) AS finished_at
    FROM landing_calls
    GROUP BY trajectory_id
)
SELECT s.trajectory_id, s.deployment_id, f.reward, s.n_calls, s.n_completion_tokens, s.started_at, s.finished_at
FROM served s
JOIN scored f ON f.trajectory_id = s.trajectory_id
WHERE s.n_deployments = 1
  AND s.deployment_id = '{deployment_id}'
  AND s.trajectory_id NOT IN (SELECT trajectory_id FROM trajectories WHERE round <> {round})
ORDER BY s.started_at, s.trajectory_id
LIMIT {limit}
