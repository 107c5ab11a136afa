"""The terminal base model: generic sessions recorded in real sandboxes, a tokenizer fit to them, a tiny
pre-training through sft.py that is reproducible from its seed, and the build cache."""
import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import base_model  # noqa: E402
import common  # noqa: E402
import labels  # noqa: E402
import taskgen  # noqa: E402

TINY = ["--sessions", "4", "--commands", "5", "--vocab", "400", "--hidden", "32", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--epochs", "1", "--batch-size", "2", "--max-len", "1024", "--concurrency", "4", "--heldout", "2",
        "--prompt-template", str(Path(__file__).resolve().parents[1] / "scripts" / "toy_prompt.txt")]


def test_sessions_follow_the_seed_and_stay_off_the_tasks():
    a = [base_model.random_tree(random.Random(f"0/tree/{i}")) for i in range(20)]
    assert a == [base_model.random_tree(random.Random(f"0/tree/{i}")) for i in range(20)]
    assert a != [base_model.random_tree(random.Random(f"1/tree/{i}")) for i in range(20)]
    policy = base_model.user_policy(6)
    states = [[{"role": "user", "content": base_model.session_instruction(0, i)}] for i in range(8)]
    first = policy(states)
    assert first == policy(states)
    assert len(set(first)) > 1
    # generic commands on generic files: nothing of the toy tasks' instructions or folders
    task_dirs = {p.rsplit("/", 1)[0] for s in taskgen.make_splits(45, 0, 9)["sft"] + taskgen.make_splits(0, 0, 9)["eval"]
                 for p, _, _ in s.files}
    assert not task_dirs & {p.rsplit("/", 1)[0] for tree in a for p, _, _ in tree}


def test_commands_quote_the_instructions_values_and_earlier_outputs():
    # The instruction names literal values and the scripted user types them; value_events finds exactly the
    # values a command quotes after an earlier message showed them, and says where they came from.
    policy, n, quoted = base_model.user_policy(16), 0, {"instruction": 0, "output": 0}
    for i in range(12):
        facts, tree = base_model.session_facts(0, i), base_model.session_tree(0, i)
        instr = base_model.session_instruction(0, i)
        assert 2 <= len(facts) and all(v in instr and k in instr for k, v in facts)
        screen = "\n".join(t for _, t, _ in tree) + "\n".join(p for p, _, _ in tree)  # every file shown
        conv = [{"role": "user", "content": instr}]
        for _ in range(8):
            conv += [{"role": "assistant", "content": policy([conv])[0]}, {"role": "user", "content": screen}]
        for j, a, b, source in base_model.value_events(conv):
            v = conv[j]["content"][a:b]
            assert conv[j]["role"] == "assistant" and (v in instr) == (source == "instruction")
            assert v in [v for _, v in facts] + base_model.tree_ids(tree) + [Path(p).name for p, _, _ in tree]
            quoted[source] += 1
        n += len(conv) // 2
    assert quoted["instruction"] > n / 8 and quoted["output"] > n / 20, (quoted, n)
    # a value typed before anything showed it is not a copy
    v = base_model.session_facts(0, 0)[0][1]
    conv = [{"role": "user", "content": "Task: (session 0-0)"}, {"role": "assistant", "content": f"echo {v}"}]
    assert base_model.value_events(conv) == []
    conv[0]["content"] = base_model.session_instruction(0, 0)
    assert base_model.value_events(conv) == [(1, 5, 5 + len(v), "instruction")]


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
    model = Qwen3ForCausalLM(common.tiny_config(4096, 32, 1, 2, 1)).eval()
    assert base_model.repeat_accuracy(model, torch.arange(300, 4000), n=8) < 0.05


@pytest.mark.slow
def test_build_records_pretrains_and_reuses(tmp_path, no_leftovers):
    out = tmp_path / "base"
    model_dir = Path(base_model.main(["--out", str(out)] + TINY))
    rows = [json.loads(line) for line in (out / "sessions.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    conv = rows[0]["conversations"]
    assert [m["role"] for m in conv[:3]] == ["user", "assistant", "user"]
    assert base_model.session_instruction(0, 0) in conv[0]["content"]
    typed = [c["keystrokes"] for m in conv[1::2] for c in json.loads(m["content"])["commands"]]  # protocol replies
    shown = "".join(m["content"] for m in conv[2::2])
    tree = base_model.random_tree(random.Random("0/tree/0"))
    assert typed and typed[0].rstrip("\n") in shown  # the typed command echoed by the real terminal ...
    assert any(Path(p).name in shown for p, _, _ in tree)  # ... and its real output
    tok = labels.load_tokenizer(model_dir, "native")
    assert tok.chat_template == labels.PREFIX_TEMPLATE
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(tok.get_vocab())
    for text in (shown, conv[1]["content"]):  # the BPE is fit to the terminal's text and to the JSON replies
        assert len(tok(text)["input_ids"]) < len(text.encode()) * 2 / 3  # bytes would be 1 token each
    held = [json.loads(line)["conversations"] for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert len(held) == 2 and all("(session 0-4)" in c[0]["content"] or "(session 0-5)" in c[0]["content"] for c in held)
    copy = json.loads((out / "metrics.json").read_text())["copy_accuracy"]
    assert copy["instruction"]["all"]["n"] > 0 and 0 <= copy["instruction"]["all"]["exact"] <= copy["instruction"]["all"]["rest"] <= 1
    assert copy["instruction"]["all"]["n"] == copy["instruction"]["short"]["n"] + copy["instruction"]["long"]["n"]
    assert 0 <= json.loads((out / "metrics.json").read_text())["repeat_accuracy"] <= 1
    # cached: the same settings reuse the model, others are refused
    assert base_model.main(["--out", str(out)] + TINY) == str(model_dir)
    with pytest.raises(ValueError, match="--lr"):
        base_model.main(["--out", str(out), "--lr", "1e-2"] + TINY)
    # reproducible: the same sessions and seed give the same weights
    again = tmp_path / "again"
    again.mkdir()
    for name in ("sessions.jsonl", "heldout.jsonl"):
        shutil.copy(out / name, again / name)
    base_model.main(["--out", str(again)] + TINY)
    from transformers import AutoModelForCausalLM
    a = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again / "model").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
