import copy
import math

import pytest
import torch

from prodrl_pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from prodrl_pipeline.rl.estimators import EstimatorConfig
from prodrl_pipeline.rl.logprobs import build_sequences, token_logprobs
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.trainer import TrainerConfig, _microbatches, make_optimizer, train_round
from tests.conftest import logprob_tolerance, rounding_tolerance
from tests.rl.conftest import record


def _advantages(rollouts, batch_size):
    rows = []
    for i, t in enumerate(rollouts.trajectories):
        rows.append(
            {
                "trajectory_id": t["trajectory_id"],
                "minibatch": i // batch_size,
                "reward": t["reward"],
                "advantage": (i % 3) - 1.0,
            }
        )
    return rows


def test_trainer_logprobs_match_the_engines(tiny_model, tokenizer, train_puzzles, tmp_path):
    puzzles = train_puzzles[:6] + [p for p in train_puzzles if "mateIn2" in p.themes][:6]
    exact = record(tiny_model, tokenizer, puzzles, tmp_path, "none")
    quant = record(tiny_model, tokenizer, puzzles, tmp_path, "nvfp4")
    gaps, bounds = {}, {}  # bounds: fp32 rounding, KV cache + left padding vs one right-padded pass
    for name, rollouts in (("none", exact), ("nvfp4", quant)):
        seqs = build_sequences(RecordedCalls.from_rows(rollouts.calls), tokenizer.pad_token_id)
        with torch.no_grad():
            trainer = token_logprobs(tiny_model, seqs).logprobs
        engine = torch.tensor([lp for c in rollouts.calls for lp in c["completion_logprobs"]])
        gaps[name] = (trainer - engine)[seqs.free].abs()
        bounds[name] = logprob_tolerance(engine[seqs.free])
    assert gaps["none"].max() <= bounds["none"]
    print(
        f"engine vs trainer |dlogp| on sampled tokens: none max {gaps['none'].max():.2e}, "
        f"nvfp4 mean {gaps['nvfp4'].mean():.4f} max {gaps['nvfp4'].max():.4f}"
    )
    assert gaps["nvfp4"].mean() > 10 * bounds["nvfp4"]  # quantization is a real mismatch


def positions(calls: list[dict]) -> int:
    """The token positions of `calls`: a weight's gradient sums a term of each."""
    return sum(len(c["prompt_token_ids"]) + len(c["completion_token_ids"]) for c in calls)


def _grads_after_one_step(model, calls, adv, microbatch_calls, estimator=None, qat=False):
    model = copy.deepcopy(model)
    cfg = TrainerConfig(
        steps=1,
        batch_size=len(adv),
        microbatch_calls=microbatch_calls,
        lr=1e-3,
        estimator=estimator or EstimatorConfig(type="reinforce"),
        qat=qat,
    )
    opt = make_optimizer(model, cfg, None)
    captured = {}
    orig_step = opt.step

    def step(*a, **k):
        captured.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return orig_step(*a, **k)

    opt.step = step
    reference = None
    if cfg.estimator.type == "ref_is":  # any fixed per-token log-probs stand in for the reference
        reference = {c["call_id"]: torch.tensor(c["completion_logprobs"]) for c in calls}
    rows = train_round(model, opt, RecordedCalls.from_rows(calls), adv, cfg, pad_id=0, reference=reference)
    return captured, rows


ALL_ESTIMATORS = [
    EstimatorConfig(type="reinforce"),
    EstimatorConfig(type="token_is", trust_region=True),
    EstimatorConfig(type="tis_ppo", kl_beta=0.1),
    EstimatorConfig(type="ref_is"),
    EstimatorConfig(type="score_centering"),
    EstimatorConfig(type="score_centering", truncated_is=True),
    EstimatorConfig(type="score_centering", centering="samples"),
]


@pytest.mark.parametrize(
    "estimator", ALL_ESTIMATORS, ids=lambda e: f"{e.type}-{e.centering}-{e.truncated_is}"
)
def test_microbatch_split_does_not_change_the_gradient(tiny_model, recorded, estimator):
    """1 x 8 microbatches equals 8 x 1 (here: all calls at once vs one trajectory at a time)."""
    adv = _advantages(recorded, batch_size=len(recorded.trajectories))
    one, rows_one = _grads_after_one_step(tiny_model, recorded.calls, adv, len(recorded.calls), estimator)
    many, rows_many = _grads_after_one_step(tiny_model, recorded.calls, adv, 1, estimator)
    assert one.keys() == many.keys() and one
    for name in one:
        atol = rounding_tolerance(one[name].abs().max(), positions(recorded.calls))
        torch.testing.assert_close(one[name], many[name], rtol=0, atol=atol)
    assert abs(rows_one[0]["loss"] - rows_many[0]["loss"]) < 1e-6


def test_loss_is_the_documented_aggregation(tiny_model, recorded, tokenizer):
    adv = _advantages(recorded, batch_size=len(recorded.trajectories))
    _, rows = _grads_after_one_step(tiny_model, recorded.calls, adv, microbatch_calls=4)
    # by hand: loss = -(1/B) sum_i (1/T_i) sum_t A_i log pi(a_t)
    by_traj = {a["trajectory_id"]: a["advantage"] for a in adv}
    expected = 0.0
    with torch.no_grad():
        for t in recorded.trajectories:
            calls = [c for c in recorded.calls if c["trajectory_id"] == t["trajectory_id"]]
            lp = token_logprobs(
                tiny_model, build_sequences(RecordedCalls.from_rows(calls), tokenizer.pad_token_id)
            ).logprobs
            expected -= by_traj[t["trajectory_id"]] * lp.sum().item() / t["n_completion_tokens"]
    expected /= len(recorded.trajectories)
    assert abs(rows[0]["loss"] - expected) < 1e-5


def test_resumed_training_equals_uninterrupted(tiny_model, recorded, columns, tmp_path):
    adv = _advantages(recorded, batch_size=4)  # two minibatches -> two steps
    cfg = TrainerConfig(steps=2, batch_size=4, lr=1e-2, warmup_steps=3)  # warm-up spans both rounds
    straight = copy.deepcopy(tiny_model)
    opt = make_optimizer(straight, cfg, None)
    train_round(straight, opt, columns, adv, cfg, pad_id=0)
    train_round(straight, opt, columns, adv, cfg, pad_id=0, first_step=2)

    resumed = copy.deepcopy(tiny_model)
    opt = make_optimizer(resumed, cfg, None)
    rows = train_round(resumed, opt, columns, adv, cfg, pad_id=0)
    assert [r["lr"] for r in rows] == pytest.approx([1e-2 / 3, 2e-2 / 3])
    save_checkpoint(tmp_path / "ck", resumed, opt.state_dict(), {"step": rows[-1]["step"]})
    save_checkpoint(tmp_path / "ck", resumed, opt.state_dict(), {"step": rows[-1]["step"]})  # atomic replace
    model, opt_state, meta = load_checkpoint(tmp_path / "ck")
    assert meta["step"] == 2 and not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))
    opt = make_optimizer(model, cfg, opt_state)
    rows = train_round(model, opt, columns, adv, cfg, pad_id=0, first_step=meta["step"])
    assert rows[-1]["step"] == 4 and [r["lr"] for r in rows] == pytest.approx([1e-2, 1e-2])
    for (name, a), b in zip(straight.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("qat", [False, True])
def test_first_step_has_no_staleness(tiny_model, recorded, columns, qat):
    """pi_k is the policy the first step starts from, computed the way the step computes pi (with
    QAT: through the served NVFP4 weights), so the first step's staleness is exactly 0."""
    adv = _advantages(recorded, batch_size=4)
    model, cfg = copy.deepcopy(tiny_model), TrainerConfig(steps=2, batch_size=4, qat=qat)
    rows = train_round(model, make_optimizer(model, cfg, None), columns, adv, cfg, pad_id=0)
    assert rows[1]["staleness"] > 0
    assert rows[0]["staleness"] == 0.0
    unquantized = logprob_tolerance(columns.completion_logprobs)  # a mean of rounding differences
    assert (rows[0]["engine_mismatch"] > 1e-3) if qat else (rows[0]["engine_mismatch"] <= unquantized)


def test_is_ratios_renormalize_over_a_top_k_or_top_p_support(tiny_model, tokenizer, heldout, tmp_path):
    """Same weights in engine and trainer: every IS ratio pi/mu must be 1. A trainer comparing a
    full-vocabulary pi with the processed (renormalized) mu sees log sum_S pi < 0 instead: the
    log-mass bias."""
    from prodrl_pipeline.chat.render import render_ids
    from prodrl_pipeline.engine.processing import SamplingParams
    from prodrl_pipeline.engine.rows import Request
    from prodrl_pipeline.engine.sampler import TorchEngine
    from prodrl_pipeline.envs.chess_env import ChessEpisode
    from prodrl_pipeline.records import support

    engine = TorchEngine(tiny_model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for params in (SamplingParams(top_k=5, max_tokens=6), SamplingParams(top_p=0.5, max_tokens=6)):
        prompts = [render_ids(tokenizer, ChessEpisode(p).messages) for p in heldout[:4]]
        outs = engine.generate([Request(ids, params) for ids in prompts], seed=0)
        calls = [
            {
                "call_id": f"c{i}",
                "trajectory_id": f"t{i}",
                "call_index": 0,
                "prompt_token_ids": ids,
                "completion_token_ids": o.token_ids,
                "completion_logprobs": o.logprobs,
                "topk_token_ids": o.topk_ids,
                "topk_logprobs": o.topk_logprobs,
                **support.columns(o.supports),
                "vocab_size": engine.vocab_size,
                "sampling": {"temperature": 1.0},
            }
            for i, (ids, o) in enumerate(zip(prompts, outs, strict=True))
        ]
        seqs = build_sequences(RecordedCalls.from_rows(calls), tokenizer.pad_token_id)
        with torch.no_grad():
            lp = token_logprobs(tiny_model, seqs)
        restricted = torch.tensor([s is not None and len(s) > 1 for s in seqs.support])
        assert restricted.sum() >= 10
        renormalized = (lp.logprobs - seqs.deployment_logprobs)[restricted]
        unrenormalized = (lp.full_logprobs - seqs.deployment_logprobs)[restricted]
        assert renormalized.abs().max() <= logprob_tolerance(seqs.deployment_logprobs[restricted])
        assert unrenormalized.mean() < -0.05  # the bias a missing renormalization would leave


def test_recorded_lab_calls_on_policy_model_the_tail_exactly(tiny_model, tokenizer, train_puzzles, tmp_path):
    """Real engine, real constraint (S = the legal moves), K = 2 < |S| < V, no quantization: the
    trainer's pi_S mass outside the recorded head equals the engine's, 1 - sum_H mu (alpha = 1)."""
    rollouts = record(tiny_model, tokenizer, train_puzzles[:8], tmp_path, "none", top_logprobs=2)
    seqs = build_sequences(RecordedCalls.from_rows(rollouts.calls), tokenizer.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(tiny_model, seqs)
    sizes = torch.tensor([tiny_model.config.vocab_size if s is None else len(s) for s in seqs.support])
    sampled = seqs.free & (sizes > 2)
    assert sampled.sum() >= 8 and torch.all(sizes[sampled] < tiny_model.config.vocab_size)
    mu_tail = 1 - seqs.head_deployment_logprobs[sampled].exp().sum(-1)
    torch.testing.assert_close(lp.tail_logprobs[sampled].exp(), mu_tail.float(), rtol=1e-4, atol=2e-6)


def test_gradients_are_clipped_to_the_configured_norm(tiny_model, recorded, columns):
    """Adam's first moment after one step is (1 - beta1) * g: its norm shows the clipped gradient."""
    adv = _advantages(recorded, batch_size=4)
    for clip in (1e-4, 0.0):  # 0 disables clipping
        model = copy.deepcopy(tiny_model)
        cfg = TrainerConfig(steps=1, batch_size=4, grad_clip=clip)
        opt = make_optimizer(model, cfg, None)
        (row,) = train_round(model, opt, columns, adv[:4], cfg, pad_id=0)
        first_moment = torch.sqrt(sum((s["exp_avg"] ** 2).sum() for s in opt.state.values()))
        applied = float(first_moment) / (1 - cfg.beta1)
        assert row["grad_norm"] > 1e-3  # the gradient the step computed, before clipping
        expected = clip if clip else row["grad_norm"]
        assert applied == pytest.approx(expected, rel=1e-3), clip


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"steps": 0}, "^trainer.steps must be >= 1, got 0$"),
        ({"batch_size": 0}, "^trainer.batch_size must be >= 1, got 0$"),
        ({"microbatch_calls": 0}, "^trainer.microbatch_calls must be >= 1, got 0$"),
        ({"logprob_chunk_tokens": 0}, "^trainer.logprob_chunk_tokens must be >= 1, got 0$"),
        ({"lr": 0.0}, "^trainer.lr must be > 0, got 0.0$"),
        ({"resume_every": -1}, "^trainer.resume_every must be >= 0, got -1$"),
        ({"warmup_steps": -1}, "^trainer.warmup_steps must be >= 0, got -1$"),
        ({"tokens": "text"}, "^trainer.tokens must be 'recorded' or 'retokenized', got 'text'$"),
    ],
)
def test_trainer_configs_it_cannot_honour_are_refused_with_the_reason(bad, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**bad)


def test_the_learning_rate_warms_up_linearly_over_global_steps():
    edge = TrainerConfig(
        steps=1,
        batch_size=1,
        microbatch_calls=1,
        logprob_chunk_tokens=1,
        resume_every=0,
        warmup_steps=0,
        tokens="retokenized",
        lr=1e-9,
    )
    assert edge.lr_at(1) == 1e-9  # no warm-up
    cfg = TrainerConfig(lr=0.4, warmup_steps=4)
    assert [cfg.lr_at(s) for s in (1, 2, 4, 5, 40)] == [0.1, 0.2, 0.4, 0.4, 0.4]


def test_a_stored_optimizer_state_continues_under_this_rounds_hyperparameters(tiny_model):
    first = TrainerConfig(lr=1e-3, beta1=0.8, beta2=0.9)
    opt = make_optimizer(tiny_model, first, None)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["betas"] == (0.8, 0.9)
    tiny_model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    later = make_optimizer(tiny_model, TrainerConfig(lr=2e-4, beta1=0.5, beta2=0.95), state)
    assert later.param_groups[0]["lr"] == 2e-4 and later.param_groups[0]["betas"] == (0.5, 0.95)
    moments = [s["exp_avg"] for s in later.state.values()]
    assert len(moments) == len(state["state"]) and all(
        torch.equal(a, b["exp_avg"]) for a, b in zip(moments, state["state"].values(), strict=True)
    )


def test_step_diagnostics_summarize_every_microbatch_of_the_step(tiny_model, recorded, columns):
    """Each step's diagnostics cover all of its tokens, over several microbatches (two calls each):
    on policy, pi = pi_k = mu at the first step, so the total mismatch is the engine's (both ~0); a
    cap below every IS ratio (all 1 on policy) truncates every token; a PPO clip of 1e-6 clips none
    at the first step (r = 1) and some at the second, after a large step."""
    adv = _advantages(recorded, batch_size=4)
    tis = EstimatorConfig(type="tis_ppo", is_cap=0.5, eps_low=1e-6, eps_high=1e-6)
    model, cfg = (
        copy.deepcopy(tiny_model),
        TrainerConfig(steps=2, batch_size=4, lr=5e-2, microbatch_calls=2, estimator=tis),
    )
    rows = train_round(model, make_optimizer(model, cfg, None), columns, adv, cfg, pad_id=0)
    rounding = logprob_tolerance(columns.completion_logprobs)  # both are means of rounding differences
    assert abs(rows[0]["total_mismatch"] - rows[0]["engine_mismatch"]) <= rounding
    assert rows[0]["total_mismatch"] <= rounding
    assert [r["rho_truncated_fraction"] for r in rows] == [1.0, 1.0]
    assert rows[0]["clip_fraction"] == 0.0 < rows[1]["clip_fraction"]


def test_the_trust_region_counts_the_trajectories_it_drops_over_every_microbatch(tiny_model, recorded):
    """mu recorded 0.3 nats below pi on every sampled token: every trajectory's mean Bernoulli KL
    exceeds a delta of 1e-9, so all four of the step's trajectories are dropped, spread over its
    microbatches of two calls; the engine mismatch is the shift."""
    for call in recorded.calls:
        call["completion_logprobs"] = [v - 0.3 for v in call["completion_logprobs"]]
    adv = [a for a in _advantages(recorded, batch_size=4) if a["minibatch"] == 0]
    tr = EstimatorConfig(type="token_is", trust_region=True, trust_region_delta=1e-9)
    model, cfg = (
        copy.deepcopy(tiny_model),
        TrainerConfig(steps=1, batch_size=4, microbatch_calls=2, estimator=tr),
    )
    calls = RecordedCalls.from_rows(recorded.calls)
    [row] = train_round(model, make_optimizer(model, cfg, None), calls, adv, cfg, pad_id=0)
    assert row["dropped_trajectories"] == 4
    assert row["engine_mismatch"] == pytest.approx(0.3, abs=1e-4)


def test_inputs_the_trainer_cannot_use_are_refused_with_the_reason(tiny_model, recorded, columns):
    adv = _advantages(recorded, batch_size=4)
    model = copy.deepcopy(tiny_model)
    ref = TrainerConfig(steps=2, batch_size=4, estimator=EstimatorConfig(type="ref_is"))
    with pytest.raises(
        ValueError, match=r"^estimator ref_is needs reference log-probs from the dequantized deployment$"
    ):
        train_round(model, make_optimizer(model, ref, None), columns, adv, ref, pad_id=0)
    cfg = TrainerConfig(steps=2, batch_size=4)
    orphan = [*adv, {**adv[0], "trajectory_id": "nobody"}]
    with pytest.raises(ValueError, match=r"^trajectory nobody has an advantage but no calls$"):
        train_round(model, make_optimizer(model, cfg, None), columns, orphan, cfg, pad_id=0)


def _call(trajectory: str, index: int, prompt: int, completion: int) -> dict:
    """A call of forced tokens (a one-token support at each position)."""
    return {
        "call_id": f"{trajectory}-{index}",
        "trajectory_id": trajectory,
        "call_index": index,
        "vocab_size": 10,
        "sampling": {"temperature": 1.0},
        "prompt_token_ids": [1] * prompt,
        "completion_token_ids": [2] * completion,
        "completion_logprobs": [0.0] * completion,
        "topk_token_ids": [[2]] * completion,
        "topk_logprobs": [[0.0]] * completion,
        "support_size": [1] * completion,
        "support_token_ids": [[]] * completion,
    }


def test_microbatches_pack_whole_trajectories_shortest_first_in_call_order():
    """Trajectories by their longest call (prompt + completion), packed greedily up to `size` calls
    (one larger than `size` alone), each trajectory's calls in call order."""
    calls = [
        _call("long", 1, 10, 30),  # longest call 40
        _call("long", 0, 5, 5),
        _call("mid", 0, 20, 5),  # 25: a long prompt, a short completion
        _call("short", 1, 3, 3),  # 8
        _call("short", 0, 2, 2),
        _call("big", 0, 1, 1),  # 4 calls of 2: longer than size alone, and shortest
        _call("big", 2, 1, 1),
        _call("big", 1, 1, 1),
        _call("big", 3, 1, 1),
    ]
    layout = [
        [(calls[i]["trajectory_id"], calls[i]["call_index"]) for i in mb]
        for mb in _microbatches(RecordedCalls.from_rows(calls), size=3)
    ]
    assert layout == [
        [("big", 0), ("big", 1), ("big", 2), ("big", 3)],
        [("short", 0), ("short", 1), ("mid", 0)],  # exactly size: not split
        [("long", 0), ("long", 1)],
    ]
    assert _microbatches(RecordedCalls.from_rows([]), size=3) == []


def test_a_new_optimizer_starts_at_the_configured_learning_rate(tiny_model):
    cfg = TrainerConfig(lr=3e-3, beta1=0.8, beta2=0.9)
    [group] = make_optimizer(tiny_model, cfg, None).param_groups
    assert (group["lr"], group["betas"]) == (3e-3, (0.8, 0.9))


def test_each_step_reports_its_row_exactly_and_hands_it_to_progress(tiny_model, recorded, columns):
    """The per-step row: its fields, the minibatch it trained (trajectories, tokens, mean reward),
    the lag behind the behaviour checkpoint, zero clip and truncation fractions for an estimator
    that neither clips nor truncates, and the learning rate the optimizer actually used."""
    adv = _advantages(recorded, batch_size=4)
    model, cfg = copy.deepcopy(tiny_model), TrainerConfig(steps=2, batch_size=4, lr=1e-3, warmup_steps=10)
    opt, seen = make_optimizer(model, cfg, None), []
    rows = train_round(
        model, opt, columns, adv, cfg, pad_id=0, first_step=5, behaviour_step=3, progress=seen.append
    )
    assert seen == rows and [r["step"] for r in rows] == [6, 7]
    assert set(rows[0]) == {
        "step", "estimator", "n_trajectories", "n_tokens", "reward_mean", "loss", "lr", "grad_norm",
        "entropy", "engine_mismatch", "staleness", "total_mismatch", "clip_fraction",
        "rho_truncated_fraction", "kl", "dropped_trajectories", "policy_lag_steps", "seconds",
    }  # fmt: skip
    length = {c["trajectory_id"]: 0 for c in recorded.calls}
    for c in recorded.calls:
        length[c["trajectory_id"]] += len(c["completion_token_ids"])
    for row, mb in zip(rows, (adv[:4], adv[4:8]), strict=True):
        assert row["estimator"] == "score_centering" and row["n_trajectories"] == 4
        assert row["n_tokens"] == sum(length[a["trajectory_id"]] for a in mb)
        assert row["reward_mean"] == pytest.approx(sum(a["reward"] for a in mb) / 4)
        assert row["clip_fraction"] == 0.0 and row["rho_truncated_fraction"] == 0.0
        assert row["dropped_trajectories"] == 0 and row["entropy"] > 0 and 0 < row["seconds"] < 600
    assert [r["policy_lag_steps"] for r in rows] == [2, 3]  # behind the checkpoint at step 3
    assert [r["lr"] for r in rows] == [cfg.lr_at(6), cfg.lr_at(7)] == [6e-4, 7e-4]
    assert opt.param_groups[0]["lr"] == rows[-1]["lr"]


@pytest.mark.parametrize(
    ("estimator", "reads"),
    [
        (EstimatorConfig(type="reinforce"), set()),
        (EstimatorConfig(), {"head_logprobs", "tail_logprobs"}),
        (EstimatorConfig(centering="samples"), {"extra_logprobs"}),
        (EstimatorConfig(type="token_is", trust_region=True), {"complement_logprobs"}),
    ],
)
def test_each_pass_computes_only_the_log_probs_it_reads(
    tiny_model, recorded, columns, monkeypatch, estimator, reads
):
    """The pi_k pass asks for no optional output, each step for what its estimator reads and the
    entropy it reports (each output is at least one more pass over [tokens, V])."""
    import prodrl_pipeline.rl.trainer as trainer

    asked = []

    def recording(model, seqs, chunk_tokens, w_hat, outputs):  # the trainer's own token_logprobs
        asked.append(set(outputs))
        return token_logprobs(model, seqs, chunk_tokens, w_hat, outputs)

    monkeypatch.setattr(trainer, "token_logprobs", recording)
    cfg = TrainerConfig(steps=1, batch_size=4, estimator=estimator)
    model = copy.deepcopy(tiny_model)
    train_round(model, make_optimizer(model, cfg, None), columns, _advantages(recorded, 4)[:4], cfg, 0)
    passes = len(asked) // 2  # as many microbatches in the pi_k pass as in the one step
    assert asked == [set()] * passes + [reads | {"entropy"}] * passes and passes >= 1
    assert estimator.reads == reads


def _free_call(trajectory: str, index: int, prompt: list[int], completion: list[int], vocab: int) -> dict:
    """A call sampled from the whole vocabulary (every position free), mu recorded as -1 - t/10."""
    mu = [-1.0 - t / 10 for t in range(len(completion))]
    return {
        "call_id": f"{trajectory}-{index}",
        "trajectory_id": trajectory,
        "call_index": index,
        "vocab_size": vocab,
        "sampling": {"temperature": 1.0},
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": mu,
        "topk_token_ids": [[t] for t in completion],
        "topk_logprobs": [[x] for x in mu],
        "support_size": [vocab] * len(completion),
        "support_token_ids": [[] for _ in completion],
    }


@pytest.mark.parametrize("microbatch_calls", [1, 16])
@pytest.mark.parametrize("estimator", ["reinforce", "token_is"])
def test_each_trajectory_weighs_one_over_its_own_token_count_in_the_gradient(
    tiny_model, tokenizer, estimator, microbatch_calls
):
    """g = (1/B) sum_i (1/T_i) sum_t w A_i grad log pi(a_t), by brute force: two trajectories of
    T_a = 3 and T_b = 4 + 2 = 6 completion tokens (b in two calls), each token's log pi from the
    model's own logits (the whole vocabulary is the support), the loss -g summed by hand over
    tokens and differentiated by autograd; w = 1 (reinforce) or sg(pi/mu) (token_is). Weighting by
    1/sum_i T_i, or dropping 1/T_i or 1/B, changes the two trajectories' shares: the gradient."""
    vocab = tiny_model.config.vocab_size
    calls = [
        _free_call("a", 0, [5, 6, 7], [40, 41, 42], vocab),
        _free_call("b", 0, [8, 9], [50, 51, 52, 53], vocab),
        _free_call("b", 1, [8, 9, 50, 51, 52, 53, 10], [60, 61], vocab),
    ]
    adv = [
        {"trajectory_id": "a", "minibatch": 0, "reward": 1.0, "advantage": 1.0},
        {"trajectory_id": "b", "minibatch": 0, "reward": 0.0, "advantage": -0.5},
    ]
    tokens = {"a": 3, "b": 6}
    model = copy.deepcopy(tiny_model)
    expected_loss = 0.0
    for call in calls:
        ids = call["prompt_token_ids"] + call["completion_token_ids"]
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        start = len(call["prompt_token_ids"])
        for t, token in enumerate(call["completion_token_ids"]):
            lp = logits[start + t - 1].log_softmax(-1)[token]  # the logits before the token predict it
            w = 1.0 if estimator == "reinforce" else math.exp(lp.item() - call["completion_logprobs"][t])
            a = next(x["advantage"] for x in adv if x["trajectory_id"] == call["trajectory_id"])
            expected_loss = expected_loss - w * a * lp / (len(adv) * tokens[call["trajectory_id"]])
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}

    cfg = TrainerConfig(
        steps=1,
        batch_size=2,
        microbatch_calls=microbatch_calls,
        grad_clip=0.0,
        estimator=EstimatorConfig(type=estimator),
    )
    model = copy.deepcopy(tiny_model)
    opt = make_optimizer(model, cfg, None)
    captured = {}
    opt.step = lambda: captured.update({n: p.grad.clone() for n, p in model.named_parameters()})
    (row,) = train_round(model, opt, RecordedCalls.from_rows(calls), adv, cfg, pad_id=tokenizer.pad_token_id)
    assert captured.keys() == expected.keys()
    for name, grad in expected.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(captured[name], grad, rtol=1e-4, atol=1e-7)
    assert row["loss"] == pytest.approx(expected_loss.item(), rel=1e-5)
    assert row["n_tokens"] == 9 and row["n_trajectories"] == 2
