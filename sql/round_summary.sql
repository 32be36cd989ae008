-- One row per round of an experiment: mean reward of the traffic it trained on, held-out solve
-- rate of the deployment it produced (round 0 = the base deployment) on the puzzles every round
-- was evaluated on (rounds that evaluate the full set also count only those), overall and for
-- mate-in-1 and mate-in-2 puzzles, and the mean per-step
-- engine mismatch |log pi_k - log mu|, staleness |log pi - log pi_k|, KL(pi || pi_k) estimate and
-- clip fraction of its training.
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
), evaluated AS (
    SELECT round, puzzle_id, solved, themes
    FROM eval_results
    WHERE deployment_id = 'base' OR deployment_id = concat('{experiment}-r', lpad(CAST(round AS VARCHAR), 6, '0'))
), common AS (  -- the puzzles every round was evaluated on (a round may evaluate more: the full set)
    SELECT puzzle_id
    FROM evaluated
    GROUP BY puzzle_id
    HAVING count(DISTINCT round) = (SELECT count(DISTINCT round) FROM evaluated)
), heldout AS (
    SELECT round, avg(CASE WHEN solved THEN 1.0 ELSE 0.0 END) AS heldout_solve_rate,
           avg(CASE WHEN themes LIKE '%mateIn1%' THEN (CASE WHEN solved THEN 1.0 ELSE 0.0 END) END) AS mate_in_1,
           avg(CASE WHEN themes LIKE '%mateIn2%' THEN (CASE WHEN solved THEN 1.0 ELSE 0.0 END) END) AS mate_in_2,
           count(*) AS heldout_puzzles
    FROM evaluated
    WHERE puzzle_id IN (SELECT puzzle_id FROM common)
    GROUP BY round
)
SELECT heldout.round, train.trajectories, train.train_reward, heldout.heldout_solve_rate,
       heldout.mate_in_1, heldout.mate_in_2, heldout.heldout_puzzles, steps.engine_mismatch, steps.staleness,
       steps.kl, steps.clip_fraction, steps.last_step
FROM heldout
LEFT JOIN train ON train.round = heldout.round
LEFT JOIN steps ON steps.round = heldout.round
ORDER BY heldout.round
