"""evaluate.py and compare.py: the pass@k estimator against exact rationals, the tables and the comparison on
synthetic results with known answers, the bootstrap interval, infrastructure failures, the time breakdown and its
FLOP count, resume (real sandboxes, the scripted expert as the policy) and an end-to-end evaluation with real vLLM."""
import json
import math
import re
from fractions import Fraction

import numpy as np
import pytest

import envs
import evaluate
from actobs import compare, episode, labels, passk, taskgen, terminus, tiny


def exact(n, c, k):
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_pass_at_k_is_exact_for_small_n():
    for n in range(1, 33):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert passk.pass_at_k(n, c, k) == exact(n, c, k), (n, c, k)


def test_pass_at_k_large_n():
    # Exact where the binomials are past a float's precision (or range), and the product form agrees to rounding.
    for n, c, k in [(2000, 1, 16), (2000, 1999, 16), (10_000, 37, 1000), (500, 250, 250)]:
        assert math.comb(n, k) > 2 ** 53
        assert passk.pass_at_k(n, c, k) == exact(n, c, k)
        product = 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1))) if n - c >= k else 1.0
        assert passk.pass_at_k(n, c, k) == pytest.approx(product, rel=1e-12, abs=1e-15)
    assert passk.pass_at_k(16, 0, 16) == 0.0 and passk.pass_at_k(16, 1, 16) == 1.0
    assert passk.pass_at_k(np.int64(4), np.int64(1), 1) == 0.25


@pytest.mark.parametrize("n,c,k", [(4, 1, 5), (4, 5, 1), (4, -1, 1), (-1, 0, 1), (4, 1, 0), (4, 1, -2)])
def test_pass_at_k_rejects_bad_input(n, c, k):
    with pytest.raises(ValueError, match="pass@"):
        passk.pass_at_k(n, c, k)


def test_pass_at_k_rejects_non_integers():
    with pytest.raises(TypeError):
        passk.pass_at_k(4.0, 1, 1)


def test_mean_pass_at_k_skips_tasks_with_too_few_attempts():
    assert passk.mean_pass_at_k([(4, 2), (4, 0)], 2) == (pytest.approx((5 / 6 + 0) / 2), 2)
    assert passk.mean_pass_at_k([(4, 2), (1, 1)], 2) == (5 / 6, 1)
    assert passk.mean_pass_at_k([(1, 1)], 2) == (None, 0)


def test_rise_z_known_answers():
    # 10/40 -> 20/40: pooled 30/80 = 0.375, se = sqrt(0.375 * 0.625 * (2 / 40)) = 0.10825..., z = 0.25 / se
    assert passk.rise_z((10, 40), (20, 40)) == pytest.approx(0.25 / math.sqrt(0.375 * 0.625 / 20))
    assert passk.rise_z((20, 40), (10, 40)) == pytest.approx(-passk.rise_z((10, 40), (20, 40)))  # one-sided
    assert passk.rise_z((5, 20), (10, 40)) == 0.0  # the same rate
    assert passk.rise_z((0, 16), (0, 128)) == passk.rise_z((16, 16), (128, 128)) == 0.0  # nothing to compare


def test_draw_noise_separates_the_task_draw_from_the_attempts():
    # bench.draw_noise's null runs: tasks that all solve alike leave z at the attempts' spread (sd ~1) whatever the
    # draw; tasks that either always or never solve (a rate from 8 attempts: no shrinking needed) make the draw all
    # of it, unless the last steps draw the first steps' tasks again
    from bench import draw_noise
    import numpy as np

    def results(rates):
        return {"tasks": {f"t{i}": {"kind": f"k{i % 4}", "heldout": False, "attempts": [
            {"reward": float(a < r * 8), "failure": None} for a in range(8)]} for i, r in enumerate(rates)}}

    def sd(rates, draw):
        rng = np.random.default_rng(0)
        return np.std([draw_noise.null_z(draw_noise.task_rates(results(rates)), draw, rng, 2, 4, 8)
                       for _ in range(2000)])
    alike, split = [0.5] * 16, [0.0, 1.0] * 8
    assert draw_noise.task_rates(results(alike))["k0"] == [0.5] * 4
    assert 0.85 < sd(alike, "grpo") < 1.15 and 0.85 < sd(alike, "same") < 1.15
    assert sd(split, "grpo") > 2.5 and sd(split, "same") == 0.0  # 0/1 tasks: the same tasks solve the same
    assert draw_noise.task_rates(results(split))["k1"] == [1.0] * 4


# ----------------------------------------------------------------------------------------------------------
# Synthetic results

def attempt(i, reward, failure=None):
    return {"attempt": i, "reward": float(reward), "turns": 3, "tokens": 900, "generated": 300, "wall_s": 1.0,
            "start_s": 0.2, "env_s": 0.1, "policy_s": 0.6, "verify_s": 0.05, "failure": failure, "error": ""}


def results(tasks, attempts=4):
    """tasks: {name: (kind, [reward or (reward, failure)])}."""
    out = {"settings": {"attempts": attempts}, "tasks": {}}
    for name, (kind, rewards) in tasks.items():
        recs = [attempt(i, *(r if isinstance(r, tuple) else (r,))) for i, r in enumerate(rewards)]
        out["tasks"][name] = {"path": name, "kind": kind, "heldout": kind in taskgen.HELDOUT_KINDS, "attempts": recs}
    return out


INFRA = sorted(episode.INFRA_FAILURES)[0]


def test_summary_and_table_known_answers():
    res = results({
        "a1": ("archive", [1, 1, 0, 0]),  # c = 2
        "f1": ("find_copy", [0, 0, 0, (0, "max_turns")]),  # c = 0
        "f2": ("find_copy", [1, (1, INFRA), (0, "parse_errors"), 0, 1]),  # infra attempt excluded: n = 4, c = 2
        "w1": ("word_count", [1, 1, 1, 1]),  # c = 4
    })
    s = passk.summarize(res["tasks"], [1, 2, 4])
    assert s["pass@k"][1] == pytest.approx((0.5 + 0 + 0.5 + 1) / 4)
    assert s["pass@k"][2] == pytest.approx((5 / 6 + 0 + 5 / 6 + 1) / 4)
    assert s["pass@k"][4] == pytest.approx(3 / 4)
    assert (s["solved"], s["attempts"], s["excluded"]) == (3, 16, 1)
    assert s["failures"] == {"max_turns": 1, "parse_errors": 1} and s["infra"] == {INFRA: 1}

    rows = {label: tasks for label, tasks in passk.groups(res)}
    assert list(rows) == ["all", "archive (held-out)", "seen kinds", "find_copy", "word_count"]
    assert set(rows["seen kinds"]) == {"f1", "f2", "w1"}
    assert passk.summarize(rows["find_copy"], [1])["pass@k"][1] == pytest.approx(0.25)

    text = evaluate.table(res)
    print(text)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["tasks", "pass@1", "pass@2", "pass@4"]
    assert lines[1].split()[:6] == ["all", "4", "50.0", "66.7", "75.0", "3"]
    assert lines[2].split()[:6] == ["archive", "(held-out)", "1", "50.0", "83.3", "100.0"]
    assert "1 excluded as infrastructure failures" in text and f"({INFRA} 1)" in text


def test_infra_failures_never_count_against_the_agent():
    # A task whose every attempt failed for infrastructure reasons drops out of pass@k; it is not a 0.
    res = results({"ok": (None, [1, 0]), "broken": (None, [(0, f) for f in sorted(episode.INFRA_FAILURES)][:2])},
                  attempts=2)
    s = passk.summarize(res["tasks"], [1, 2])
    assert s["pass@k"] == {1: 0.5, 2: 1.0} and s["tasks@k"] == {1: 1, 2: 1}
    assert s["excluded"] == len(res["tasks"]["broken"]["attempts"]) and s["failures"] == {}
    assert "only tasks with at least k valid attempts" in evaluate.table(res)
    assert [label for label, _ in passk.groups(res)] == ["all"]  # no kinds, no per-kind rows


def test_second_try_needs_network_and_tampered_are_reported_apart():
    res = results({"py": ("python", [0, 1, 0, 0]), "go": ("go", [0, 0, 0, 1])})
    res["settings"]["second_try"] = True
    py, go = res["tasks"]["py"]["attempts"], res["tasks"]["go"]["attempts"]
    py[0].update(reward=1.0, first_reward=0.0)  # solved on the second try: counts for the final pass@k only
    go[1]["needs_network"] = "E: Temporary failure resolving 'deb.debian.org'"
    go[3]["tampered"] = ["/usr/local/bin/tr"]  # Harbor's semantics: its reward of 1 stands, and it is counted
    assert passk.summarize(res["tasks"], [1])["pass@k"][1] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert passk.summarize(res["tasks"], [1], first=True)["pass@k"][1] == pytest.approx((1 / 4 + 1 / 4) / 2)
    assert passk.summarize(res["tasks"], [1])["failures"] == {"needs network": 1, "tampered": 1}
    lines = evaluate.table(res).splitlines()
    assert [ln.split()[:5] for ln in lines[1:3]] == [["all", "1st", "try", "2", "25.0"],
                                                     ["all", "2nd", "try", "2", "37.5"]]
    assert [ln.split()[0] for ln in lines[3:7]] == ["go", "go", "python", "python"]
    assert any(ln.startswith("needs network: 1 attempts") for ln in lines)
    assert any(ln.startswith("tampered: 1 attempts") for ln in lines)


def test_results_from_before_the_network_options_resume_with_them_off(tmp_path):
    """A results file from before a setting was recorded resumes where the run asks what it ran with; one from before
    the protocol was Harbor's Terminus-2 (no protocol recorded) never does: its attempts were told other things."""
    ran = ["--model", "m", "--tasks", str(tmp_path), "--max-parse-errors", "3", "--no-summarize"]  # as they ran
    now = evaluate.settings_of(evaluate.parse_args(ran))
    old = {k: v for k, v in now.items() if k not in passk.NEWER_KEYS or k == "protocol"}
    (tmp_path / "r.json").write_text(json.dumps({"settings": old, "config": {}, "sessions": 1, "tasks": {}}))
    assert evaluate.open_results(tmp_path / "r.json", now)["sessions"] == 1
    (tmp_path / "older.json").write_text(json.dumps({"settings": {k: v for k, v in old.items() if k != "protocol"},
                                                     "config": {}, "sessions": 1, "tasks": {}}))
    with pytest.raises(SystemExit, match=r"\(protocol differ"):
        evaluate.open_results(tmp_path / "older.json", now)
    with pytest.raises(SystemExit, match="network differ"):
        evaluate.open_results(tmp_path / "r.json",
                              evaluate.settings_of(evaluate.parse_args(ran + ["--network", "host"])))
    with pytest.raises(SystemExit, match="top_p, top_k differ"):  # they sampled the full softmax
        evaluate.open_results(tmp_path / "r.json", evaluate.settings_of(evaluate.parse_args(
            ran + ["--top-p", "0.95", "--top-k", "20"])))


def test_a_policy_that_trains_samples_the_full_softmax(tokenizer):
    """Log-probs a trainer's ratio divides by are the full softmax's at T: a truncated sampler (top-p, top-k) is
    refused where the replies carry log-probs, and allowed for evaluation, which carries none."""
    from actobs import engine
    kw = dict(temperature=0.6, max_new_tokens=8, max_len=64)
    with pytest.raises(ValueError, match="top_p 1 and top_k 0"):
        engine.VLLMPolicy(None, tokenizer, top_p=0.95, **kw)
    assert engine.VLLMPolicy(None, tokenizer, top_p=0.95, top_k=20, logprobs=False, **kw).params["top_k"] == 20


def test_results_say_whether_replies_were_constrained(tmp_path):
    """--grammar (bare: the reply grammar) is in the results' settings, a setting a resume must keep; the table says
    whether the replies were constrained; a results file from before the flag was unconstrained."""
    base = ["--model", "m", "--tasks", str(tmp_path), "--out", str(tmp_path / "r.json")]
    on, think, off = (evaluate.settings_of(evaluate.parse_args(base + x)) for x in (["--grammar"],
                                                                                     ["--grammar", "think"], []))
    assert (on["grammar"], think["grammar"], off["grammar"]) == ("reply", "think", None)
    assert "grammar" in passk.RESUME_KEYS
    assert "replies constrained by the reply grammar (--grammar reply)" in evaluate.table(
        {"settings": dict(on, attempts=1), "tasks": {}})
    assert "replies unconstrained" in evaluate.table({"settings": {"attempts": 1}, "tasks": {}})
    (tmp_path / "r.json").write_text(json.dumps({"settings": on, "config": {}, "sessions": 1, "tasks": {}}))
    with pytest.raises(SystemExit, match="grammar differ"):
        evaluate.open_results(tmp_path / "r.json", off)


def test_compare_known_answers(tmp_path):
    a = results({"t1": (None, [1, 0, 0, 0]), "t2": (None, [0, 0, 0, 0]), "t3": (None, [1, 1, 0, 0])})
    b = results({"t1": (None, [1, 1, 0, 0]), "t2": (None, [1, 0, 0, 0]), "t3": (None, [1, 1, 0, 0]),
                 "extra": (None, [1, 1, 1, 1])})  # not in A: left out of every number
    cmp = compare.compare([("A", a), ("B", b), ("A again", a)], n_boot=2000, seed=0)
    assert cmp["ks"] == [1, 2, 4] and cmp["tasks"] == [3, 4, 3] and cmp["common"] == 3
    assert cmp["solved"] == [2, 3, 2]
    r1 = cmp["rows"][0]
    assert r1["pass"] == pytest.approx([0.75 / 3, 1.25 / 3, 0.75 / 3])
    assert r1["diff"][1] == pytest.approx(0.5 / 3) and r1["rel"][1] == pytest.approx(2 / 3)
    assert r1["diff"][2] == 0 and r1["ci"][2] == (0.0, 0.0)
    lo, hi = r1["ci"][1]
    assert 0 <= lo <= r1["diff"][1] <= hi <= 0.25  # the per-task differences are 0.25, 0.25 and 0
    r4 = cmp["rows"][2]
    assert r4["pass"] == pytest.approx([2 / 3, 1.0, 2 / 3]) and r4["rel"][1] == pytest.approx(0.5)
    text = compare.compare_table(cmp)
    print(text)
    lines = text.splitlines()
    assert lines[4].split()[:6] == ["pass@1", "3", "25.0", "41.7", "25.0", "+16.7"] and "+66.7%" in lines[4]
    assert lines[-2].split()[:5] == ["solved", "3", "2", "3", "2"]
    # The CLI on files: the same numbers, and a PNG.
    for name, r in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    png = tmp_path / "p.png"
    out = evaluate.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--png", str(png),
                         "--n-boot", "2000"])
    assert out["rows"][0]["ci"][1] == r1["ci"][1] and png.stat().st_size > 5000


def test_results_record_the_hand_off_setting_and_each_attempts_hand_offs(tmp_path):
    """--summarize (on by default, as Harbor's Terminus-2) is in the results' settings; an attempt's record lists how
    each of its hand-offs made its new context, None for one after which none fit; one without hand-offs has none."""
    base = ["--model", "m", "--tasks", str(tmp_path)]
    assert evaluate.settings_of(evaluate.parse_args(base))["summarize"] is True
    assert evaluate.settings_of(evaluate.parse_args(base + ["--no-summarize"]))["summarize"] is False
    ep = episode.Episode("t", [], handoffs=[episode.Handoff(at=3, fallback="summary", start=10),
                                            episode.Handoff(at=7, fallback=None)])
    assert evaluate.attempt_record(0, ep)["handoffs"] == ["summary", None]
    assert "handoffs" not in evaluate.attempt_record(0, episode.Episode("t", []))


def test_compare_by_kind_and_changed_settings(tmp_path, capsys):
    a = results({"a1": ("archive", [1, 0]), "f1": ("find_copy", [0, 0]), "f2": ("find_copy", [1, 1])}, attempts=2)
    b = results({"a1": ("archive", [1, 1]), "f1": ("find_copy", [1, 0]), "f2": ("find_copy", [1, 1])}, attempts=2)
    b["settings"]["temperature"] = 0.6
    assert compare.compare([("A", a), ("B", b)], n_boot=100)["settings_differ"] == ["temperature"]
    for name, r in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    evaluate.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--by-kind", "--n-boot", "100"])
    blocks = capsys.readouterr().out.split("\n== ")
    assert [b.splitlines()[0] for b in blocks[1:]] == ["archive (held-out)", "seen kinds", "find_copy"]
    held = blocks[1].splitlines()
    assert held[4].split()[:6] == ["pass@1", "1", "50.0", "100.0", "+50.0", "+100.0%"]
    assert "differ in more than the model: temperature" in blocks[0]


# ----------------------------------------------------------------------------------------------------------
# Where the time goes

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, vocab_size=300, tie_word_embeddings=True)  # heads x head_dim (96) != hidden: both count


def test_forward_flops_match_torchs_flop_counter():
    # A forward pass of T tokens computes the full (T, T) attention matrices (the causal mask zeroes, it does not
    # skip), so torch counts T * forward_flops(T): every matmul weight twice per token, attention at context T.
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3Config, Qwen3ForCausalLM
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, attn_implementation="eager")).eval()
    T = 37
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, TINY["vocab_size"], (1, T)))
    assert counter.get_total_flops() == T * tiny.forward_flops(TINY, T)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))  # the head included
    assert tiny.forward_flops(TINY, 0) == 2 * linear


def test_time_breakdown_known_answers():
    recs = [attempt(0, 1), attempt(1, 0), {**attempt(2, 0), "turns": 6, "tokens": 1, "generated": 0, "wall_s": 4.0}]
    stats = {"wall_s": 2.0, "policy_s": 1.5, "config": TINY, "dtype": "float32", "threads": 1, "matmul_flop_s": 1e9}
    b = evaluate.time_breakdown(recs, stats, setup_s=7.0)
    assert (b["attempts"], b["wall_s"], b["setup_s"], b["generated"]) == (3, 2.0, 7.0, 600)
    assert b["phases"]["policy_s"] == {"sum_s": pytest.approx(1.8), "mean_s": pytest.approx(0.6),
                                       "at_once": pytest.approx(0.9)}
    assert b["phases"]["attempt_s"]["sum_s"] == 6.0 and b["phases"]["attempt_s"]["at_once"] == 3.0
    assert b["turns_mean"] == 4.0 and b["gen_tok_s"] == 300.0 and b["engine_busy_frac"] == 0.75
    assert b["engine_tok_s"] == 400.0
    # every token of each episode once, at the context of its position
    flops = sum(tiny.forward_flops(TINY, p) for a in recs for p in range(a["tokens"]))
    x = b["bound"]
    assert x["flops"] == pytest.approx(flops, rel=1e-12) and x["tokens"] == 1801
    assert x["compute_s"] == pytest.approx(flops / 1e9) and x["of_wall"] == pytest.approx(flops / 1e9 / 2.0)
    assert x["gen_tok_s"] == pytest.approx(600 / (flops / 1e9)) and x["of_busy"] == pytest.approx(flops / 1e9 / 1.5)
    text = evaluate.breakdown_text(b)
    print(text)
    lines = text.splitlines()
    assert lines[0].startswith("time: 3 attempts in 2s (after 7s of setup") and "busy 75% of the wall" in lines[0]
    assert lines[4].split() == ["policy", "wait", "1.8", "0.60", "0.9"] and lines[6].split()[-1] == "3.0"
    assert "600 tokens generated: 300 tok/s over the wall, 400 over" in lines[7] and "FLOP bound" in lines[8]
    assert lines[9].split()[0] == f"{x['gen_tok_s']:.0f}" and f"reached {100 * x['of_wall']:.0f}% of it" in lines[9]
    breakdown = evaluate.time_breakdown(recs, {"wall_s": 2.0, "policy_s": 1.5}, 0.0)
    assert "FLOP bound" not in evaluate.breakdown_text(breakdown)


def test_bootstrap_is_seeded_and_covers_the_true_difference():
    # Tasks drawn from a population where run B solves each task 10 points more often than A; the interval
    # over tasks must cover 0.10 about 95% of the time, and the same seed must give the same interval.
    rng, hits, reps = np.random.default_rng(1), 0, 200
    for rep in range(reps):
        p_a = rng.uniform(0.0, 0.8, size=60)
        c_a, c_b = rng.binomial(8, p_a), rng.binomial(8, p_a + 0.1)
        a = [passk.pass_at_k(8, int(c), 1) for c in c_a]
        b = [passk.pass_at_k(8, int(c), 1) for c in c_b]
        lo, hi = compare.bootstrap_diff(a, b, n_boot=1000, seed=rep)
        hits += lo <= 0.1 <= hi
        if rep == 0:
            assert compare.bootstrap_diff(a, b, 1000, seed=0) == (lo, hi)
            assert compare.bootstrap_diff(a, b, 1000, seed=1) != (lo, hi)
            assert 0.03 < hi - lo < 0.2
    assert 0.88 <= hits / reps <= 0.99, hits



def test_bootstrap_within_kinds_covers_the_difference_of_a_split_drawn_per_kind():
    # A split drawn as 6 tasks of each of 5 kinds (as taskgen.make_splits draws it), where B's gain depends on the
    # kind (0 to +0.4; the split's true difference is their mean, 0.2). Resampling within kinds must still cover
    # it about 95% of the time, and be narrower than the pooled bootstrap, which counts the spread between kinds.
    rng, hits, width, pooled, reps = np.random.default_rng(2), 0, 0.0, 0.0, 200
    kinds = np.repeat(np.arange(5), 6)
    gain = np.array([0.0, 0.1, 0.2, 0.3, 0.4])[kinds]  # (30,)
    for rep in range(reps):
        p_a = rng.uniform(0.0, 0.5, size=30)
        a = [passk.pass_at_k(8, int(c), 1) for c in rng.binomial(8, p_a)]
        b = [passk.pass_at_k(8, int(c), 1) for c in rng.binomial(8, p_a + gain)]
        lo, hi = compare.bootstrap_diff(a, b, n_boot=1000, seed=rep, strata=kinds)
        hits += lo <= 0.2 <= hi
        width += (hi - lo) / reps
        plo, phi = compare.bootstrap_diff(a, b, n_boot=1000, seed=rep)
        pooled += (phi - plo) / reps
    assert 0.88 <= hits / reps <= 0.99, hits
    assert width < 0.9 * pooled, (width, pooled)
    # one kind: the pooled bootstrap's draws, each resample's deviation from the mean scaled by sqrt(30 / 29)
    m, c = np.mean(np.subtract(b, a)), math.sqrt(30 / 29)
    plo, phi = compare.bootstrap_diff(a, b, 500, seed=3)
    assert compare.bootstrap_diff(a, b, 500, seed=3, strata=["k"] * 30) == pytest.approx((m + c * (plo - m),
                                                                                          m + c * (phi - m)))
    # 4 tasks of one kind, three lost by B: the plain resample reaches -1 (all four draws a lost task), and the
    # stretch by sqrt(4 / 3) would carry the interval past it, where no difference of pass rates is; it is clipped
    d, c = [-1.0, -1.0, -1.0, 0.0], math.sqrt(4 / 3)
    plo, phi = compare.bootstrap_diff([0.0] * 4, d, 10_000, seed=0)
    lo, hi = compare.bootstrap_diff([0.0] * 4, d, 10_000, seed=0, strata=["k"] * 4)
    assert plo == -1.0 and -0.75 + c * (plo + 0.75) < -1.0
    assert lo == -1.0 and hi == pytest.approx(-0.75 + c * (phi + 0.75))

# ----------------------------------------------------------------------------------------------------------
# Real sandboxes: the scripted expert stands in for the model at the rollout boundary

@pytest.fixture
def toy_tasks(tmp_path, base_image):
    """Two held-out toy tasks as Harbor folders (archive and find_copy), and one whose image does not build."""
    root = tmp_path / "eval"
    for spec in taskgen.make_splits(0, 0, 2, seed=0)["eval"]:
        taskgen.write_harbor(spec, root / spec.name, base_image)
    broken = root / "zz-broken"
    taskgen.write_harbor(taskgen.make_splits(0, 0, 2, seed=1)["eval"][1], broken, base_image)
    (broken / "environment" / "Dockerfile").write_text(f"FROM {base_image}\nRUN exit 3\n")
    return root


def expert_rollout(calls, stop_after=None):
    """The rollout boundary with the scripted expert as the policy (envs.run_episodes, as vllm_rollout calls it);
    with stop_after the run is killed once that many episodes have been reported, others still live."""
    def rollout(tasks, on_episode, stats):
        calls.append([t.name for t in tasks])
        reported = []

        def report(i, ep):
            on_episode(i, ep)
            reported.append(i)
            if len(reported) == stop_after:
                raise KeyboardInterrupt
        return envs.run_episodes(tasks, taskgen.expert_policy, max_turns=12, concurrency=4, on_episode=report,
                                 stats=stats)
    return rollout


def recorded(path):
    res = json.loads(path.read_text())
    return res, {(name, a["attempt"]): a for name, e in res["tasks"].items() for a in e["attempts"]}


def test_resume_runs_only_missing_attempts(toy_tasks, tmp_path, no_leftovers):
    out, transcripts = tmp_path / "res.json", tmp_path / "episodes.jsonl"
    argv = ["--model", "unused-by-this-rollout", "--tasks", str(toy_tasks), "--attempts", "2", "--out", str(out),
            "--transcripts", str(transcripts)]
    broken = "actobs/" + taskgen.make_splits(0, 0, 2, seed=1)["eval"][1].name
    calls = []
    with pytest.raises(KeyboardInterrupt):  # killed after 3 episodes
        evaluate.evaluate(evaluate.parse_args(argv), rollout=expert_rollout(calls, stop_after=3))
    first, done = recorded(out)
    everything = {(name, i) for name in first["tasks"] for i in range(2)}
    assert len(first["tasks"]) == 3 and len(done) >= 3
    assert [(c["args"]["attempts"], c["args"]["out"]) for c in first["configs"]] == [(2, str(out))]  # what ran
    for (name, _), a in done.items():  # the broken image did not stop the run; its attempts are infra failures
        assert a["failure"] == ("image_build_error" if name == broken else None), a["error"]

    calls.clear()
    res = evaluate.evaluate(evaluate.parse_args(argv), rollout=expert_rollout(calls))
    assert len(calls) == 1 and sorted(calls[0]) == sorted(name for name, _ in everything - done.keys())
    _, final = recorded(out)
    assert final.keys() == everything and all(final[key] == a for key, a in done.items())  # done stays done
    assert all(a["reward"] == 1.0 for (name, _), a in final.items() if name != broken)  # the expert solves them
    assert "exit 3" in final[broken, 0]["error"]
    toy = [e for name, e in res["tasks"].items() if name != broken]
    assert {e["kind"] for e in toy} == {"archive", "find_copy"} and [e["heldout"] for e in toy].count(True) == 1
    assert res["summary"]["excluded"] == 2 and res["summary"]["tasks@k"] == {1: 2, 2: 2}
    assert res["summary"]["pass@k"] == {1: 1.0, 2: 1.0}
    assert len(res["configs"]) == 2 and res["configs"][0] == first["configs"][0]  # what ran, one per session
    # the second session's time: its attempts only; 4 sandboxes at most at once; the broken image's take none
    took = res["configs"][1]["time"]
    assert took["attempts"] == len(calls[0]) and "bound" not in took  # the expert has no FLOPs
    assert 0 < took["phases"]["attempt_s"]["at_once"] <= 4 and took["phases"]["start_s"]["sum_s"] > 0
    for (name, _), a in final.items():
        phases = [a[k] for k in evaluate.PHASES]
        assert (sum(phases) == 0) if name == broken else (0 < sum(phases) <= a["wall_s"] + 0.01 and a["env_s"] > 0), a
    # every recorded attempt has its transcript: its record and the conversation
    episodes = {(r["task"], r["attempt"]): r for r in map(json.loads, transcripts.read_text().splitlines())}
    assert episodes.keys() >= final.keys()
    for key, a in final.items():
        r = episodes[key]
        assert {k: r[k] for k in a} == a
        if key[0] == broken:
            assert r["conversations"] == []
        else:
            conv = r["conversations"]
            assert [m["role"] for m in conv] == ["user", "assistant"] * (len(conv) // 2) and len(conv) >= 4
            assert terminus.parse_reply(conv[-1]["content"])[0].task_complete  # the expert's confirmation
            assert conv[0]["content"].startswith(terminus.DEFAULT_PROMPT.split("{")[0])

    calls.clear()  # complete: nothing runs
    evaluate.evaluate(evaluate.parse_args(argv), rollout=expert_rollout(calls))
    assert calls == [] and recorded(out)[1] == final
    # --retry-infra runs the infrastructure failures again (the image still does not build), and nothing else.
    res = json.loads(out.read_text())
    for a in res["tasks"][broken]["attempts"]:
        a["error"] = "stale"
    out.write_text(json.dumps(res))
    evaluate.evaluate(evaluate.parse_args(argv + ["--retry-infra"]), rollout=expert_rollout(calls))
    _, again = recorded(out)
    assert {k: a for k, a in again.items() if k[0] != broken} == {k: a for k, a in final.items() if k[0] != broken}
    assert [again[broken, i]["failure"] for i in (0, 1)] == ["image_build_error"] * 2
    assert "exit 3" in again[broken, 1]["error"]
    with pytest.raises(SystemExit, match="temperature"):
        evaluate.evaluate(evaluate.parse_args(argv + ["--temperature", "0.5"]), rollout=expert_rollout(calls))


@pytest.mark.slow
def test_end_to_end_under_the_grammar_every_reply_parses(vllm_dir, tmp_path, base_image, no_leftovers):
    """evaluate.py --grammar on the tiny random checkpoint, which writes no valid reply on its own (the test below):
    in real sandboxes every reply it ends parses, warned at most of a command without its newline before the next
    (a random policy's free strings run long: a reply max_new_tokens cut is the only exception), and the results say
    the replies were constrained."""
    root = tmp_path / "eval"
    for spec in taskgen.make_splits(0, 0, 2, seed=0)["eval"]:
        taskgen.write_harbor(spec, root / spec.name, base_image)
    out, log = tmp_path / "grammar.json", tmp_path / "grammar.jsonl"
    res = evaluate.main(["--model", str(vllm_dir), "--tasks", str(root), "--attempts", "2", "--max-turns", "2",
                         "--max-new-tokens", "900", "--max-len", "4096", "--concurrency", "4", "--dtype", "float32",
                         "--out", str(out), "--transcripts", str(log), "--grammar"])
    assert json.loads(out.read_text())["settings"]["grammar"] == "reply" and res["summary"]["excluded"] == 0
    tok = labels.load_tokenizer(vllm_dir, "native")
    replies = [m["content"] for line in log.read_text().splitlines()
               for m in json.loads(line)["conversations"] if m["role"] == "assistant"]
    cut = [r for r in replies if len(tok(r)["input_ids"]) > 850]
    assert len(replies) >= 4 and len(cut) <= len(replies) // 4, len(cut)
    newline = re.compile(re.escape(terminus.NO_NEWLINE).replace(r"\{i\}", r"\d+"))  # the one warning it can draw
    for r in replies:
        error, warnings = terminus.parse_reply(r)[1:]
        assert r in cut or error is None and all(newline.fullmatch(w) for w in warnings), r


def test_end_to_end_tiny_checkpoint_with_vllm(vllm_dir, tmp_path, base_image, no_leftovers):
    """grpo's vLLM rollout on a tiny random checkpoint: 2 toy tasks x 4 attempts in real sandboxes."""
    root = tmp_path / "eval"
    for spec in taskgen.make_splits(0, 0, 2, seed=0)["eval"]:
        taskgen.write_harbor(spec, root / spec.name, base_image)
    out = tmp_path / "tiny.json"
    argv = ["--model", str(vllm_dir), "--tasks", str(root), "--attempts", "4", "--max-turns", "2",
            "--max-new-tokens", "24", "--max-len", "3072", "--concurrency", "8", "--dtype", "float32",
            "--out", str(out)]
    res = evaluate.main(argv)
    saved = json.loads(out.read_text())
    assert len(saved["tasks"]) == 2 and len(saved["configs"]) == 1 and saved["configs"][0]["vllm"]  # its version
    for entry in saved["tasks"].values():
        assert [a["attempt"] for a in entry["attempts"]] == [0, 1, 2, 3]
        for a in entry["attempts"]:
            # A random model writes no valid reply: the agent fails, the infrastructure does not.
            assert a["failure"] in ("parse_errors", "max_turns", "max_len") and a["reward"] == 0.0, a
            assert 1 <= a["turns"] <= 2 and a["tokens"] > a["generated"] > 0 and a["wall_s"] > 0
    assert res["summary"]["attempts"] == 8 and res["summary"]["excluded"] == 0
    assert res["summary"]["pass@k"] == {1: 0.0, 2: 0.0, 4: 0.0}
    took = saved["configs"][0]["time"]  # the FLOP bound from the engine's own config, dtype and threads
    assert took["attempts"] == 8 and took["generated"] == sum(a["generated"] for e in saved["tasks"].values()
                                                               for a in e["attempts"])
    assert took["bound"]["dtype"] == "float32" and took["bound"]["matmul_flop_s"] > 1e8
    assert took["bound"]["threads"] == 1  # the CPU engine serves with one intra-op thread, as vLLM means to
    assert 0 < took["engine_busy_frac"] <= 1 and took["bound"]["flops"] > 0
    assert evaluate.main(argv)["tasks"] == res["tasks"]  # complete: a second run has nothing left to do
