-- Advantages of one round (docs/estimators.md): A_i = R_i - b, b = the mean reward of i's minibatch.
-- Scored trajectories are shuffled by a seeded hash of their id, cut into minibatches of
-- {batch_size}, and the first {steps} minibatches are kept: one row per trained trajectory.
WITH scored AS (
    SELECT trajectory_id, round, reward,
           row_number() OVER (ORDER BY md5(concat(trajectory_id, '{seed}'))) - 1 AS rn
    FROM trajectories
    WHERE round = {round} AND reward IS NOT NULL
), batched AS (
    SELECT trajectory_id, round, reward, CAST(rn / {batch_size} AS BIGINT) AS minibatch
    FROM scored
)
SELECT trajectory_id,
       round,
       minibatch,
       reward,
       avg(reward) OVER (PARTITION BY minibatch) AS baseline,
       reward - avg(reward) OVER (PARTITION BY minibatch) AS advantage
FROM batched
WHERE minibatch < {steps}
ORDER BY minibatch, trajectory_id
