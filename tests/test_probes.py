"""The paper's probes: gradient geometry identities, entropy / KL / NLL against plain references, temperature
matching on a model with a known answer, exact wrapper and command token labels, every CLI subcommand."""
import json
import math
import random
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import nemotron_rows, synthetic_trajectory
import probes
import sft
from actobs import common, geometry, labels, terminus

P, A, O = labels.PROMPT, labels.ACTION, labels.OBS



@pytest.fixture(scope="module")
def examples(tokenizer):
    rng = random.Random(5)
    return [labels.render(tokenizer, synthetic_trajectory(rng), max_len=200) for _ in range(5)]


def grads_of(model, loss):
    model.zero_grad()
    loss.backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return g


# ----------------------------------------------------------------------------------------------------------
# Gradient geometry

def test_identical_losses_give_cos_1_and_r_1(model, examples, tokenizer):
    ids, roles = examples[0]
    sup = [r != P for r in roles]
    as_act = (ids, [A if s else P for s in sup])  # the same tokens, once as actions, once as observations
    as_obs = (ids, [O if s else P for s in sup])
    geo = geometry.grad_geometry(model, [common.collate([as_act, as_obs], tokenizer.pad_token_id)])
    assert geo["cos"] == pytest.approx(1.0, abs=1e-5) and geo["r"] == pytest.approx(1.0, rel=1e-4)
    assert geo["norm_act"] > 0


def test_geometry_is_lambda_consistent_and_accumulates_over_batches(model, examples, tokenizer):
    """For one trajectory, g_lam = a g_act + b g_obs with a = |A| / (|A| + lam |O|), b = lam |O| / (...):
    |g_lam|^2 must follow from (cos, norm_act, norm_obs) for every lam. Split into micro-batches, the norms
    must be those of the whole held-out set's mean losses."""
    pad = tokenizer.pad_token_id
    one = common.collate(examples[:1], pad)
    geo = geometry.grad_geometry(model, [one])
    r = torch.tensor(examples[0][1][1:])
    n_a, n_o = int((r == A).sum()), int((r == O).sum())
    for lam in (0.25, 1.0, 3.0):
        a, b = n_a / (n_a + lam * n_o), lam * n_o / (n_a + lam * n_o)
        want = ((a * geo["norm_act"]) ** 2 + (b * geo["norm_obs"]) ** 2
                + 2 * a * b * geo["cos"] * geo["norm_act"] * geo["norm_obs"])
        got = grads_of(model, sft.actobs_loss(model, one, lam)[0]).norm() ** 2
        assert got.item() == pytest.approx(want, rel=1e-4)
    assert geo["r"] == pytest.approx(geo["norm_obs"] / geo["norm_act"])

    whole = common.collate(examples, pad)
    g_act = grads_of(model, sft.actobs_loss(model, whole, 0.0)[0])
    g_obs = grads_of(model, sft.actobs_loss(model, whole, 1.0, w_act=0.0)[0])
    sentinel = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, s in zip(model.parameters(), sentinel):
        p.grad = s
    model.train()
    parts = [common.collate(examples[:2], pad), common.collate(examples[2:3], pad), common.collate(examples[3:], pad)]
    geo = geometry.grad_geometry(model, parts)
    assert geo["norm_act"] == pytest.approx(g_act.norm().item(), rel=1e-4)
    assert geo["norm_obs"] == pytest.approx(g_obs.norm().item(), rel=1e-4)
    assert geo["cos"] == pytest.approx(torch.nn.functional.cosine_similarity(g_act, g_obs, 0).item(), abs=1e-4)
    assert 0 < abs(geo["cos"]) < 0.999
    assert all(p.grad is s for p, s in zip(model.parameters(), sentinel)) and model.training  # left as found
    model.zero_grad(set_to_none=True)
    model.eval()


def test_geometry_without_observations_is_a_clear_error(model, tokenizer):
    with pytest.raises(ValueError, match="observation"):
        geometry.grad_geometry(model, [common.collate([([1, 2, 3], [P, A, A])], tokenizer.pad_token_id)])


# ----------------------------------------------------------------------------------------------------------
# Entropy, KL, NLL over full distributions, in chunks

def test_entropy_of_uniform_is_log_v_and_matches_reference():
    V, H = 257, 8
    assert torch.allclose(probes.token_entropy(torch.randn(5, H), torch.zeros(V, H), 0.7),
                          torch.full((5,), math.log(V)))
    h, W = torch.randn(11, H), torch.randn(V, H)
    ref = torch.distributions.Categorical(logits=h @ W.T / 1.3).entropy()
    torch.testing.assert_close(probes.token_entropy(h, W, 1.3, chunk=4), ref)


def test_kl_is_zero_on_itself_nonnegative_and_matches_reference():
    V, H = 300, 6
    h, W, h2, W2 = torch.randn(9, H), torch.randn(V, H), torch.randn(9, H), torch.randn(V, H)
    assert probes.token_kl(h, W, h, W, chunk=4).abs().max() < 1e-5
    kl = probes.token_kl(h, W, h2, W2, chunk=4)
    ref = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=h @ W.T),
                                            torch.distributions.Categorical(logits=h2 @ W2.T))
    assert (kl >= 0).all()
    torch.testing.assert_close(kl, ref, rtol=1e-4, atol=1e-5)
    nll = probes.token_nll(h, W, torch.arange(9), chunk=4)
    torch.testing.assert_close(nll, torch.nn.functional.cross_entropy(h @ W.T, torch.arange(9), reduction="none"))


class FixedLogits(torch.nn.Module):
    """A policy whose next-token logits are the same at every position: its entropy at T is known exactly."""

    def __init__(self, logits):
        super().__init__()
        self.lm_head = torch.nn.Linear(1, len(logits), bias=False)
        self.lm_head.weight.data = logits[:, None].clone()

    base_model = property(lambda self: self)
    device = property(lambda self: self.lm_head.weight.device)

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(last_hidden_state=torch.ones(*input_ids.shape, 1))  # (B, T, 1)

    def get_output_embeddings(self):
        return self.lm_head


def test_bisection_recovers_a_known_temperature():
    torch.manual_seed(0)
    z = torch.randn(50) * 3
    exact = lambda t: torch.distributions.Categorical(logits=z / t).entropy().item()  # noqa: E731
    m = FixedLogits(z)
    rng = random.Random(0)

    def sample(prompts, t, max_new_tokens, seed):  # any sampler with this signature drops in (e.g. vLLM)
        return [[rng.randrange(50) for _ in range(rng.randint(0, max_new_tokens))] for _ in prompts]

    prompts = [[1, 2, 3], [4], [5, 6]]
    assert probes.self_entropy(m, prompts, sample(prompts, 1.0, 8, 0), 0.9) == pytest.approx(exact(0.9), rel=1e-5)
    t_star, trace = probes.match_temperature(lambda t: probes.self_entropy(m, prompts, sample(prompts, t, 8, 0), t),
                                             exact(0.64))
    assert abs(t_star - 0.64) < 0.01 and len(trace) > 5
    with pytest.raises(ValueError, match="outside"):
        probes.match_temperature(exact, math.log(50) + 1)


# ----------------------------------------------------------------------------------------------------------
# Token labels: observation wrapper vs payload, command keystrokes

NEW, FIX = "New Terminal Output:\n", "\n\nPlease fix these issues and provide a proper JSON response."
ERR, STATE = "Previous response had parsing errors:\nERROR:", "Current terminal state:\n"
# "\n\nAre you sure you want to mark the task as complete? ..."
SURE = terminus.COMPLETION_CHECK.split("{observation}")[1]


def conversation(first_obs):
    reply = json.dumps({"analysis": "a", "plan": "p", "commands": [{"keystrokes": "ls -la /app\n", "duration": 0.1}],
                        "task_complete": False}, indent=2)
    return [{"role": "system", "content": 'Reply with JSON, e.g. {"keystrokes": "cd /tmp\\n"}.'},
            {"role": "user", "content": "Task: list /app.\n\nCurrent terminal state:\nroot@box:/app# "},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": first_obs},
            {"role": "assistant", "content": "oops"},
            {"role": "user", "content": ERR + " No valid JSON found in response" + FIX},
            {"role": "assistant", "content": reply.replace("ls -la /app", "cat /app/notes.txt | grep -n key")},
            {"role": "user", "content": STATE + NEW + "root@box:/app#" + SURE}]


def test_wrapper_split_labels_exactly_the_wrapper_tokens(tokenizer):
    cut = "\n[... output limited to 10000 bytes; 71 interior bytes omitted ...]\n"
    msgs = conversation(NEW + "root@box:/app# ls -la /app\nnotes" + cut + "txt\nroot@box:/app# ")
    ids, roles, wrap = probes.obs_split(tokenizer, msgs)
    dec = lambda sel: "".join(tokenizer.decode([i]) for i, s in zip(ids, sel) if s)  # noqa: E731
    # BPE merges '#' with the '\n\n' that opens the last wrapper: that token straddles, so it is payload
    assert dec(wrap) == NEW + cut + "<|im_end|>" + ERR + FIX + "<|im_end|>" + STATE + NEW + SURE[2:] + "<|im_end|>"
    assert dec((roles == O) & ~wrap) == "root@box:/app# ls -la /app\nnotes" + "txt\nroot@box:/app# " + \
        " No valid JSON found in response" + "root@box:/app#\n\n"
    assert not wrap[roles != O].any()  # the prompt's 'Current terminal state:' is PROMPT, not a wrapper


def test_wrapper_split_on_the_real_rows(tokenizer):
    for row in nemotron_rows():
        msgs = row["conversations"]
        ids, roles, wrap = probes.obs_split(tokenizer, msgs)
        wrapper_text = "".join(tokenizer.decode([i]) for i, w in zip(ids, wrap) if w)
        obs = [m["content"] for m, r in zip(msgs, labels.message_labels(msgs)) if r == O]
        assert wrapper_text.count("New Terminal Output") == sum(c.count("New Terminal Output") for c in obs) > 0
        assert wrapper_text.count("<|im_end|>") == len(obs) and "root@" not in wrapper_text
        assert 0 < wrap.sum() < 0.1 * (roles == O).sum()


def test_token_straddling_wrapper_and_payload_is_payload(tokenizer):
    assert tokenizer.tokenize(":\n\n") == [tokenizer.tokenize(":\n\n")[0]]  # one merged token in this vocabulary
    msgs = conversation(NEW + "\nroot@box:/app# ls\n")
    ids, roles, wrap = probes.obs_split(tokenizer, msgs)
    first = [tokenizer.decode([i]) for i, r in zip(ids, roles) if r == O][:5]
    k = first.index(":\n\n")
    assert [w for w, r in zip(wrap, roles) if r == O][: k + 1] == [True] * k + [False]


def test_command_tokens_are_the_keystrokes_of_assistant_turns(tokenizer):
    msgs = conversation(NEW + "x\n")
    ids, commands = probes.command_tokens(tokenizer, msgs)
    want = ["ls -la /app\\n", "cat /app/notes.txt | grep -n key\\n"]  # as the JSON text spells them
    assert len(commands) == 2  # the example in the system prompt is not a command the policy wrote
    for cmd, w in zip(commands, want):
        text = [tokenizer.decode([ids[t]]) for t in cmd]
        assert cmd == list(range(cmd[0], cmd[0] + len(cmd)))
        assert w in "".join(text) and "".join(text[1:-1]) in w  # covering, and minimally so


def test_batched_sampler_matches_one_prompt_at_a_time(model, tokenizer):
    prompts = [[5, 9, 30, 7, 7], [11], [40, 41, 42]]  # different lengths: left padding must not change anything
    batched = probes.hf_sampler(model, tokenizer, batch=3)(prompts, 0.01, 6, seed=0)  # T -> 0: argmax, seed-free
    single = probes.hf_sampler(model, tokenizer, batch=1)(prompts, 0.01, 6, seed=1)
    assert batched == single and all(0 < len(c) <= 6 for c in batched)
    eos = tokenizer.eos_token_id
    assert all(eos not in c[:-1] for c in batched)  # cut right after the first eos


# ----------------------------------------------------------------------------------------------------------
# The CLI on tiny checkpoints

@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    """A fake sft.py run dir (init/, step-000002/, step-000004/) and a held-out file."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("run")
    shutil.copytree(tiny_dir, root / "init")
    tok = labels.load_tokenizer(tiny_dir, "native")
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    torch.manual_seed(1)
    for step in (2, 4):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.03)
        m.save_pretrained(root / f"step-{step:06d}")
        tok.save_pretrained(root / f"step-{step:06d}")
    rng = random.Random(11)
    rows = [{"conversations": synthetic_trajectory(rng)}
            for _ in range(5)] + [{"conversations": conversation(NEW + "ok\n")}]
    (root / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def cli(run, *argv):
    return probes.main([argv[0], "--data", str(run / "heldout.jsonl"), "--max-len", "400", *argv[1:]])


def test_cli_geometry_writes_jsonl_and_curve(run):
    out = run / "geometry.jsonl"
    cli(run, "geometry", "--checkpoints", str(run / "init"), str(run / "step-000002"), str(run / "step-000004"),
        "--out", str(out), "--micro-tokens", "800")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert (run / "geometry.png").stat().st_size > 0
    from transformers import AutoModelForCausalLM  # the CLI's micro-batched value = one whole-set batch
    tok, m = (labels.load_tokenizer(run / "step-000002", "native"),
              AutoModelForCausalLM.from_pretrained(run / "step-000002"))
    convs = labels.read_trajectories(run / "heldout.jsonl")[0]
    whole = geometry.grad_geometry(m, [common.collate([labels.render(tok, c, 400) for c in convs], tok.pad_token_id)])
    assert (rows[1]["probe/cos"] == pytest.approx(whole["cos"], abs=1e-4)
            and rows[1]["probe/r"] == pytest.approx(whole["r"], rel=1e-4))
    assert rows[0]["probe/cos"] != pytest.approx(rows[2]["probe/cos"], abs=1e-3)


def test_cli_obs_nll_and_cmd_entropy(run):
    models = [str(run / "init"), str(run / "step-000004")]
    res = cli(run, "obs-nll", "--models", *models, "--out", str(run / "obs.json"))
    assert json.loads((run / "obs.json").read_text()) == res
    for v in res.values():
        assert v["wrapper_tokens"] > 0 and v["payload_tokens"] > 0 and v["payload_nll"] > 0
        n = v["wrapper_tokens"] + v["payload_tokens"]
        assert v["obs_nll"] == pytest.approx((v["wrapper_nll"] * v["wrapper_tokens"]
                                              + v["payload_nll"] * v["payload_tokens"]) / n)
    res = cli(run, "cmd-entropy", "--models", *models, "--out", str(run / "cmd.json"))
    for v in res.values():
        assert v["tokens"]["1"] >= 6 and v["tokens"]["4-7"] > 0
        assert 0 < v["entropy"]["1"] <= math.log(2048)
    assert (run / "obs.png").stat().st_size > 0 and (run / "cmd.png").stat().st_size > 0


def test_cli_entropy_match_and_kl(run):
    common = ["--n", "2", "--max-new-tokens", "6"]
    hot = cli(run, "entropy", "--model", str(run / "step-000004"), "--temperature", "1.5", *common,
              "--out", str(run / "h.json"))
    cold = cli(run, "entropy", "--model", str(run / "step-000004"), "--temperature", "0.5", *common,
               "--out", str(run / "h0.json"))
    assert 0 < cold["entropy"] < hot["entropy"]
    res = cli(run, "entropy", "--model", str(run / "step-000004"), "--match-entropy", str(run / "h.json"), *common,
              "--out", str(run / "tstar.json"))
    assert 0.5 < res["t_star"] < 3.0 and (run / "tstar.png").stat().st_size > 0
    res = cli(run, "kl", "--models", str(run / "init"), str(run / "step-000004"), "--init", str(run / "init"), *common,
              "--out", str(run / "kl.json"))
    kl = [v["kl"] for v in res.values()]
    assert abs(kl[0]) < 1e-5 and kl[1] > 1e-3 and (run / "kl.png").stat().st_size > 0


def test_bad_input_names_the_file_and_field(run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: conversations\\[0\\]: missing field 'content'"):
        probes.main(["obs-nll", "--models", str(run / "init"), "--data", str(bad), "--out", str(tmp_path / "o.json")])
    (tmp_path / "obs.json").write_text('{"obs_nll": 1.0}')
    for target, msg in ((tmp_path / "obs.json", "obs.json: no number in field 'entropy'"),
                        ("warm", "neither a number")):
        with pytest.raises(ValueError, match=msg):
            cli(run, "entropy", "--model", str(run / "init"), "--match-entropy", str(target),
                "--out", str(tmp_path / "t.json"))


def test_sft_probe_every_writes_the_curves(tiny_dir, tmp_path):
    rng = random.Random(3)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"conversations": synthetic_trajectory(rng)}) + "\n" for _ in range(20)))
    out = tmp_path / "run"
    sft.main(["--model", str(tiny_dir), "--data", str(data), "--out", str(out), "--lr", "3e-3", "--batch-size", "4",
              "--val-size", "4", "--max-len", "256", "--eval-every", "0", "--save-every", "0", "--probe-every", "2"])
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    probe = [r for r in rows if "probe/cos" in r]
    assert [r["step"] for r in probe] == [0, 2, 4]  # before training, then every 2 steps
    assert all(-1 <= r["probe/cos"] <= 1 and r["probe/r"] > 0 and r["probe/norm_act"] > 0 for r in probe)
    assert (out / "probe_geometry.png").stat().st_size > 0
