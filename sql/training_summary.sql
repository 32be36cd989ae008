-- One row per round an experiment trained (production mode, where no deployment is evaluated and
-- sql/round_summary.sql has no rows): mean reward of the traffic it trained on, and the mean
-- per-step engine mismatch |log pi_k - log mu|, staleness |log pi - log pi_k|, KL(pi || pi_k)
-- estimate and clip fraction of its training.
WITH train AS (
    SELECT round, avg(reward) AS train_reward, count(*) AS trajectories
    FROM trajectories
    GROUP BY round
), steps AS (
    SELECT round, avg(engine_mismatch) AS engine_mismatch, avg(staleness) AS staleness,
           avg(kl) AS kl, avg(clip_fraction) AS clip_fraction, max(step) AS last_step
    FROM train_steps
    WHERE experiment = '{experiment}'
    GROUP BY round
)
SELECT steps.round, train.trajectories, train.train_reward, steps.engine_mismatch, steps.staleness,
       steps.kl, steps.clip_fraction, steps.last_step
FROM steps
LEFT JOIN train ON train.round = steps.round
ORDER BY steps.round
