"""The terminal base model: generic sessions recorded in real sandboxes, a tokenizer fit to them, a tiny
pre-training through sft.py that is reproducible from its seed, and the build cache."""
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from actobs import labels, taskgen, tiny
from scripts import base_model, sessions

TINY = ["--sessions", "4", "--commands", "5", "--vocab", "400", "--hidden", "32", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--epochs", "1", "--batch-size", "2", "--max-len", "1024", "--concurrency", "4",
        "--heldout", "2",
        "--copy-steps", "3", "--copy-schedule", "8:2,16:0", "--copy-chats", "1", "--refresh-steps", "2",
        "--prompt-template", str(Path(__file__).resolve().parents[1] / "scripts" / "toy_prompt.txt")]


def test_sessions_follow_the_seed_and_stay_off_the_tasks():
    a = [sessions.random_tree(random.Random(f"0/tree/{i}")) for i in range(20)]
    assert a == [sessions.random_tree(random.Random(f"0/tree/{i}")) for i in range(20)]
    assert a != [sessions.random_tree(random.Random(f"1/tree/{i}")) for i in range(20)]
    policy = sessions.user_policy(6)
    states = [[{"role": "user", "content": sessions.session_instruction(0, i)}] for i in range(8)]
    first = policy(states)
    assert first == policy(states)
    assert len(set(first)) > 1
    # generic commands on generic files: nothing of the toy tasks' instructions or folders
    task_dirs = {p.rsplit("/", 1)[0]
                 for s in taskgen.make_splits(45, 0, 9)["sft"] + taskgen.make_splits(0, 0, 9)["eval"]
                 for p, _, _ in s.files}
    assert not task_dirs & {p.rsplit("/", 1)[0] for tree in a for p, _, _ in tree}


def test_commands_quote_the_instructions_values_and_earlier_outputs():
    # The instruction names literal values and the scripted user types them; value_events finds exactly the
    # values a command quotes after an earlier message showed them, and says where they came from.
    policy, n, quoted = sessions.user_policy(16), 0, {"instruction": 0, "output": 0}
    for i in range(12):
        facts, tree = sessions.session_facts(0, i), sessions.session_tree(0, i)
        instr = sessions.session_instruction(0, i)
        assert 2 <= len(facts) and all(v in instr and k in instr for k, v in facts)
        screen = "\n".join(t for _, t, _ in tree) + "\n".join(p for p, _, _ in tree)  # every file shown
        conv = [{"role": "user", "content": instr}]
        for _ in range(8):
            conv += [{"role": "assistant", "content": policy([conv])[0]}, {"role": "user", "content": screen}]
        for j, a, b, source in base_model.value_events(conv):
            v = conv[j]["content"][a:b]
            assert conv[j]["role"] == "assistant" and (v in instr) == (source == "instruction")
            assert v in [v for _, v in facts] + sessions.tree_ids(tree) + [Path(p).name for p, _, _ in tree]
            quoted[source] += 1
        n += len(conv) // 2
    assert quoted["instruction"] > n / 8 and quoted["output"] > n / 20, (quoted, n)
    # a value typed before anything showed it is not a copy
    v = sessions.session_facts(0, 0)[0][1]
    conv = [{"role": "user", "content": "Task: (session 0-0)"}, {"role": "assistant", "content": f"echo {v}"}]
    assert base_model.value_events(conv) == []
    conv[0]["content"] = sessions.session_instruction(0, 0)
    assert base_model.value_events(conv) == [(1, 5, 5 + len(v), "instruction")]


def test_a_value_is_determined_where_its_context_leaves_one_way_on():
    ctx = "backup: /srv/maple_570\nls /srv/data /srv/mango\nport: 8080\n"
    assert base_model.determined_at(ctx, "/srv/maple_570") == len("/srv/map")  # /srv/ma could still be /srv/mango
    assert base_model.determined_at(ctx, "8080") == 1  # the only word that starts with 8
    # an earlier occurrence goes on as a longer name: the value is a guess to its end
    assert base_model.determined_at("see abc.txt.bak and abc.txt", "abc.txt") == len("abc.txt")


@pytest.mark.parametrize("split", ["qwen", "names"])
def test_a_names_tokens_under_each_split(tmp_path, split):
    # Under Qwen's split a file name listed by `ls` and the same name typed in a path start with different tokens
    # (" d" vs "/d"): nothing earlier to copy from. Under NAME_SPLIT it is the same tokens wherever it stands.
    texts = [f"ls /etc/svc\n{n}.ini  {n}.txt\ncat /etc/svc/{n}.ini\n"
             for n in ("d8n8n", "kelp", "onyx_7", "tundra")] * 20
    tok = labels.load_tokenizer(tiny.build_tiny(tmp_path, texts, vocab_size=400, hidden=32, layers=1, heads=2,
                                                  kv_heads=1, split=split))

    def tokens(before):  # the tokens that hold a character of the name
        enc = tok(f"{before}d8n8n.ini", return_offsets_mapping=True)
        return [tok.decode([i]) for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if b > len(before)]
    same = tokens("cat /etc/svc/") == tokens("kelp.txt  ") == tokens("ls\n")
    assert same == (split == "names"), (tokens("cat /etc/svc/"), tokens("kelp.txt  "), tokens("ls\n"))


def test_copy_accuracy_scores_the_tokens_after_the_choice(tokenizer):
    # A model that types the conversation's next token everywhere but at `wrong`: missing a token the context
    # does not determine (/srv/ma... could be /srv/mango) costs "exact" and "rest" but not "determined".
    v = "/srv/maple_570"
    conv = [{"role": "user", "content": f"backup: {v} and /srv/mango"}, {"role": "assistant", "content": f"cp x {v}"}]
    text = tokenizer.apply_chat_template(conv, tokenize=False)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = enc["offset_mapping"]
    a = text.rindex(v)
    span = [t for t, (s0, s1) in enumerate(offsets) if s0 < a + len(v) and s1 > a]
    choice = [t for t in span if offsets[t][0] < a + len("/srv/map")]
    assert len(choice) >= 2 and len(span) > len(choice)  # a token of the choice after the first, and copied ones

    class Typist:
        def __init__(self, wrong):
            self.wrong = wrong

        def __call__(self, x):  # x: (1, T) -> logits (1, T, V) whose argmax at t is token t + 1 (or another)
            nxt = x[0, 1:].tolist() + [0]
            nxt = [(n + 1) % len(tokenizer) if t + 1 in self.wrong else n for t, n in enumerate(nxt)]
            return type("Out", (), {"logits": torch.nn.functional.one_hot(torch.tensor([nxt]), len(tokenizer)).float()})

    def score(wrong):
        c = base_model.copy_accuracy(Typist(wrong), tokenizer, [conv], 4096,
                                     events=lambda conv: [(1, 5, 5 + len(v), "instruction")])["instruction"]["all"]
        assert c["n"] == c["det_n"] == 1
        return c["exact"], c["rest"], c["determined"]

    assert score(set()) == (1, 1, 1)
    assert score({span[0]}) == (0, 1, 1)
    assert score({choice[-1]}) == (0, 0, 1)
    assert score({span[-1]}) == (0, 0, 0)


def test_repeats_reward_a_copy_by_content_and_not_a_fixed_look_back():
    ids, lab = base_model.repeats(torch.Generator().manual_seed(0), 64, 128, torch.arange(300, 4000))
    rows, cols = torch.nonzero(lab != -100, as_tuple=True)
    assert len(rows) > 64 * 6 and (lab[lab != -100] == ids[lab != -100]).all()

    def by_content(r, t):  # what followed the latest earlier occurrence of the previous token
        seen = (ids[r, :t - 2] == ids[r, t - 1]).nonzero()
        return ids[r, seen[-1] + 1].item() if len(seen) else -1
    assert sum(by_content(r, t) == ids[r, t] for r, t in zip(rows.tolist(), cols.tolist())) / len(rows) > 0.95
    offsets = {o: sum(ids[r, t - o] == ids[r, t] for r, t in zip(rows.tolist(), cols.tolist())) / len(rows)
               for o in range(8, 128)}
    assert max(offsets.values()) < 0.2, max(offsets.items(), key=lambda kv: kv[1])  # no look-back does it
    # a random model does not copy: the probe reads ~0 until a copy circuit is learnt
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny.tiny_config(4096, 32, 1, 2, 1)).eval()
    assert base_model.repeat_accuracy(model, torch.arange(300, 4000), n=8) < 0.05


def test_rotations_are_copies_by_content_at_offsets_that_vary():
    ids, lab = base_model.rotations(torch.Generator().manual_seed(0), 64, 64, torch.arange(300, 4000))
    rows, cols = torch.nonzero(lab != -100, as_tuple=True)
    assert len(rows) == 64 * 31 and (lab[lab != -100] == ids[lab != -100]).all()
    # each label is what followed the previous token's occurrence in the first half (the wrap-around: the first
    # half's first id); checked on the rows whose first half has no id twice, where that occurrence is unique
    first = ids[:, :32]
    distinct = [r for r in range(64) if len(set(first[r].tolist())) == 32]
    assert len(distinct) > 40
    for r, t in zip(rows.tolist(), cols.tolist()):
        if r not in distinct:
            continue
        k = (first[r] == ids[r, t - 1]).nonzero()[0].item()
        assert ids[r, t] == first[r, (k + 1) % 32]
    offsets = {o: (ids[rows, cols] == ids[rows, cols - o]).float().mean().item() for o in range(1, 33)}
    assert max(offsets.values()) < 0.2  # no single look-back predicts them


def test_copy_schedule_parses_and_names_the_flag():
    schedule = base_model.parse_schedule("32:600,64:400,128:0")
    assert [base_model.schedule_length(schedule, s)
            for s in (0, 599, 600, 999, 1000, 5000)] == [32, 32, 64, 64, 128, 128]
    assert base_model.schedule_length(base_model.parse_schedule("16:2,32:3"), 7) == 32  # past the end: the last runs on
    for bad in ("32", "32:0,64:10", "2:10", "a:b", ""):
        with pytest.raises(ValueError, match="--copy-schedule"):
            base_model.parse_schedule(bad)


def test_copy_chats_reply_with_the_users_values_rotated():
    chats = sessions.copy_chats(0, 50)
    assert chats == sessions.copy_chats(0, 50) and chats != sessions.copy_chats(1, 50)
    for user, reply in chats:
        assert (user["role"], reply["role"]) == ("user", "assistant")
        sep = next(s for s in ("\n", ", ", " ") if s in user["content"])
        values, back = user["content"].split(sep), reply["content"].split(sep)
        assert back != values and any(back == values[k:] + values[:k] for k in range(1, len(values)))


def test_the_calibration_defaults_to_the_base_models_copy_practice():
    # bench/induction.py takes its defaults from base_model's flags and train_copy's keyword defaults; train_copy's
    # positional `vocab` (a tensor of ids) must not replace the --vocab size
    from bench import induction
    cal = induction.get_parser().parse_args([])
    build = base_model.get_parser().parse_args(["--out", "x"])
    assert (cal.vocab, cal.hidden, cal.layers, cal.kv_heads, cal.steps, cal.schedule, cal.tokens, cal.lr) == (
        build.vocab, build.hidden, build.layers, build.kv_heads, build.copy_steps, build.copy_schedule,
        build.copy_tokens, build.copy_lr)
    assert (tuple(cal.betas), cal.weight_decay, cal.warmup) == ((0.9, 0.95), 0.0, 50)


@pytest.mark.slow
def test_copy_practice_forms_the_circuit_at_its_settings():
    # train_copy's defaults (lr 1e-3, betas 0.9/0.95, no weight decay, fp32) form a copy by content in a tiny model
    # within 300 steps: held-out rows it never saw go from chance to most tokens copied. At lr 3e-3 the same model
    # stays in the plateau (0.18 at step 300): the settings, not the step count, decide it.
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny.tiny_config(300, 64, 2, 2, 2))
    curve = base_model.train_copy(model, torch.arange(256, 288), 300, [(16, 0)], tokens=512, every=150,
                                  probe_lengths=(16,), log=lambda line: None)
    assert [k for k, _ in curve] == [0, 150, 300]
    assert curve[0][1][16] < 0.1 and curve[-1][1][16] > 0.6, curve


def test_the_refresh_trains_its_second_loss_beside_the_rows():
    # train_copy adds `also`'s loss to every step's: a sequence of ids the rows never hold is learnt only with it
    # (the rows alone push those ids' logits down)
    from transformers import Qwen3ForCausalLM
    seq = torch.arange(300, 340)[None]  # (1, 40): ids outside the rows' vocabulary (256-287)

    def run(also):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(tiny.tiny_config(400, 32, 1, 2, 1))
        fixed = lambda: model(input_ids=seq, labels=seq).loss  # noqa: E731
        before = fixed().item()
        base_model.train_copy(model, torch.arange(256, 288), 20, [(16, 0)], tokens=256, lr=1e-2, warmup=1,
                              also=fixed if also else None, log=lambda line: None)
        return before, fixed().item()
    (b0, rows_only), (b1, both) = run(False), run(True)
    assert b0 == b1 and rows_only > 0.9 * b0 and both < 0.5 * b0, (b0, rows_only, both)


@pytest.mark.slow
def test_build_records_pretrains_and_reuses(tmp_path, no_leftovers):
    out = tmp_path / "base"
    model_dir = Path(base_model.main(["--out", str(out)] + TINY))
    rows = [json.loads(line) for line in (out / "sessions.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    conv = rows[0]["conversations"]
    assert [m["role"] for m in conv[:3]] == ["user", "assistant", "user"]
    assert sessions.session_instruction(0, 0) in conv[0]["content"]
    typed = [c["keystrokes"] for m in conv[1::2] for c in json.loads(m["content"])["commands"]]  # protocol replies
    shown = "".join(m["content"] for m in conv[2::2])
    tree = sessions.random_tree(random.Random("0/tree/0"))
    assert typed and typed[0].rstrip("\n") in shown  # the typed command echoed by the real terminal ...
    assert any(Path(p).name in shown for p, _, _ in tree)  # ... and its real output
    tok = labels.load_tokenizer(model_dir, "native")
    assert tok.chat_template == labels.PREFIX_TEMPLATE
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(tok.get_vocab())
    for text in (shown, conv[1]["content"]):  # the BPE is fit to the terminal's text and to the JSON replies
        assert len(tok(text)["input_ids"]) < len(text.encode()) * 2 / 3  # bytes would be 1 token each
    held = [json.loads(line)["conversations"] for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert len(held) == 2 and all("(session 0-4)" in c[0]["content"] or "(session 0-5)" in c[0]["content"]
                                  for c in held)
    copy = json.loads((out / "metrics.json").read_text())["copy_accuracy"]
    assert (copy["instruction"]["all"]["n"] > 0
            and 0 <= copy["instruction"]["all"]["exact"] <= copy["instruction"]["all"]["rest"] <= 1)
    assert copy["instruction"]["all"]["n"] == copy["instruction"]["short"]["n"] + copy["instruction"]["long"]["n"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["repeat_accuracy"] <= 1 and 0 <= metrics["rotation_accuracy"] <= 1
    assert [r["step"] for r in metrics["copy_practice"]] == [0, 3]  # copy practice ran first, probed at its ends
    from transformers import AutoModelForCausalLM
    pre = AutoModelForCausalLM.from_pretrained(out / "pretrain" / "final").state_dict()
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(pre[k], base[k]) for k in pre)  # the refresh trained the pre-trained model on
    mixed = [json.loads(line)["conversations"] for line in (out / "pretrain.jsonl").read_text().splitlines()]
    assert mixed[:4] == [r["conversations"] for r in rows] and mixed[4:] == sessions.copy_chats(0, 4)
    # cached: the same settings reuse the model, others are refused
    assert base_model.main(["--out", str(out)] + TINY) == str(model_dir)
    with pytest.raises(ValueError, match="--lr"):
        base_model.main(["--out", str(out), "--lr", "1e-2"] + TINY)
    # a build from before the refresh existed (no refresh_steps in its settings) was made without one
    settings = json.loads((out / "settings.json").read_text())
    del settings["refresh_steps"]
    (out / "settings.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="--refresh-steps 0 -> 2"):
        base_model.main(["--out", str(out)] + TINY)
    settings["refresh_steps"] = 2
    (out / "settings.json").write_text(json.dumps(settings))
    # reproducible: the same sessions and seed give the same weights
    again = tmp_path / "again"
    again.mkdir()
    for name in ("sessions.jsonl", "heldout.jsonl"):
        shutil.copy(out / name, again / name)
    base_model.main(["--out", str(again)] + TINY)
    a = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again / "model").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
