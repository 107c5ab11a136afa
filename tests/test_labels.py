"""Exact action/observation labels. Each template here has a hand-written mirror that says, piece by piece,
which text the template emits and which role that text must get; render() never sees the mirror."""
import json
import random

import numpy as np
import pytest
from tokenizers import AddedToken

from actobs import labels
from conftest import QWEN3_TEMPLATE, nemotron_rows, synthetic_trajectory

P, A, O = labels.PROMPT, labels.ACTION, labels.OBS
EOT = "<|im_end|>"


def mirror_prefix(msgs):
    roles = labels.message_labels(msgs)
    out = []
    for m, r in zip(msgs, roles):
        if m["role"] == "tool":
            out += [("<|im_start|>user\n<tool_response>\n", P), (m["content"], r), ("\n</tool_response>", P),
                    (EOT, r), ("\n", P)]
        else:
            out += [(f"<|im_start|>{m['role']}\n", P), (m["content"], r), (EOT, r), ("\n", P)]
    return out


def mirror_qwen3(msgs):
    """Qwen3's template for conversations without tool calls. Its generation prompt is '<|im_start|>assistant\\n':
    the '<think>\\n' it writes after that on turns after the last user query (and the empty think block of a
    final turn without reasoning) is the model's to generate, so ACTION."""
    roles = labels.message_labels(msgs)
    last_query = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    out = []
    for i, (m, r) in enumerate(zip(msgs, roles)):
        if m["role"] in ("user", "system"):
            out += [(f"<|im_start|>{m['role']}\n", P), (m["content"], r), (EOT, r), ("\n", P)]
        elif m["role"] == "assistant":
            c = m["content"]
            reasoning = ""
            if "</think>" in c:
                reasoning = c.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                c = c.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == len(msgs) - 1 or reasoning):
                out += [("<|im_start|>assistant\n", P),
                        ("<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + c.lstrip("\n"), r)]
            else:
                out += [("<|im_start|>assistant\n", P), (c, r)]
            out += [(EOT, r), ("\n", P)]
        else:  # tool: consecutive tool turns share one user turn
            if i == 0 or msgs[i - 1]["role"] != "tool":
                out.append(("<|im_start|>user", P))
            out += [("\n<tool_response>\n", P), (m["content"], r), ("\n</tool_response>", P)]
            if i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool":
                out += [(EOT, r), ("\n", P)]
    return out


# Phi-3 style: turns close with '<|end|>', a special token of the vocabulary that is neither eos nor a named
# special token; the generation prompt is '<|assistant|>\n'.
PHI3_TEMPLATE = ("{%- for m in messages %}{{- '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}")


def mirror_phi3(msgs):
    return [x for m, r in zip(msgs, labels.message_labels(msgs))
            for x in [(f"<|{m['role']}|>\n", P), (m["content"], r), ("<|end|>", r), ("\n", P)]]


PLAIN_TEMPLATE = "{%- for m in messages %}{{- '### ' + m.role + ':\\n' + m.content + '\\n\\n' }}{%- endfor %}"


def mirror_plain(msgs):  # no special tokens at all: BPE merges straddle content and template text
    return [x for m, r in zip(msgs, labels.message_labels(msgs))
            for x in [(f"### {m['role']}:\n", P), (m["content"], r), ("\n\n", P)]]


def expected_roles(tok, text, pieces):
    """Per-token roles by the straddle rule, from the mirror's character roles and the tokenizer's offsets."""
    char = np.concatenate([np.full(len(t), r, dtype=np.int8) for t, r in pieces] + [np.zeros(1, np.int8)])
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for a, b in enc["offset_mapping"]:
        seg = set(char[a: max(b, a + 1)].tolist())
        out.append(A if A in seg else O if O in seg else P)
    return out


def conversations():
    rng = random.Random(1)
    convs = [row["conversations"] for row in nemotron_rows()] + [synthetic_trajectory(rng) for _ in range(5)]
    convs.append([{"role": "system", "content": "You run shell commands."}, {"role": "user", "content": "List /tmp."},
                  {"role": "assistant", "content": "<think>\nls it\n</think>\n\n{\"commands\": []}"},
                  {"role": "tool", "content": "a.txt"}, {"role": "tool", "content": "b.txt"},
                  {"role": "assistant", "content": "Done."}, {"role": "user", "content": "New Terminal Output:\n$ "},
                  {"role": "assistant", "content": "<think>\nfinal\n</think>\n\nok"}])
    return convs


TEMPLATES = {"prefix": (labels.PREFIX_TEMPLATE, mirror_prefix), "qwen3": (QWEN3_TEMPLATE, mirror_qwen3),
             "phi3": (PHI3_TEMPLATE, mirror_phi3), "plain": (PLAIN_TEMPLATE, mirror_plain)}


def with_template(tokenizer, name):
    tok = labels.load_tokenizer(tokenizer.name_or_path, "native")
    tok.chat_template = TEMPLATES[name][0]
    if name == "phi3":  # its turn tokens, special in the vocabulary only; eos stays another token
        tok.add_tokens([AddedToken(f"<|{t}|>", special=True, normalized=False)
                        for t in ("end", "system", "user", "assistant")])
        tok.eos_token = "<|endoftext|>"
    return tok


@pytest.fixture(params=list(TEMPLATES))
def templated(request, tokenizer):
    return request.param, with_template(tokenizer, request.param), TEMPLATES[request.param][1]


def test_roles_match_mirror_for_every_template(templated):
    name, tok, mirror = templated
    straddle = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok}"},
                {"role": "tool", "content": "x\n"}, {"role": "tool", "content": "y$\n"}]
    for msgs in conversations() + [straddle]:
        pieces = mirror(msgs)
        text = tok.apply_chat_template(msgs, tokenize=False)
        assert text == "".join(t for t, _ in pieces), f"{name}: the test's mirror of the template is off"
        ids, roles = labels.render(tok, msgs)
        assert tok.decode(ids) == text
        assert roles == expected_roles(tok, text, pieces)


@pytest.mark.parametrize("name", ["prefix", "qwen3", "phi3"])
def test_decoded_action_and_obs_tokens_are_the_contents_as_rendered(name, tokenizer):
    tok, mirror = with_template(tokenizer, name), TEMPLATES[name][1]
    for msgs in conversations():
        ids, roles = labels.render(tok, msgs)
        pieces = mirror(msgs)
        for r in (A, O):
            want = "".join(t for t, pr in pieces if pr == r)
            assert tok.decode([i for i, x in zip(ids, roles) if x == r]) == want
        assert tok.decode([i for i, x in zip(ids, roles) if x == P]) == "".join(t for t, pr in pieces if pr == P)


@pytest.mark.parametrize("reasoning", ["<think>\nfinal\n</think>\n\n", ""])
def test_qwen3_action_is_all_the_policy_writes_after_the_generation_prompt(qwen3_tokenizer, reasoning):
    """Under Qwen3's own template the last turn's '<think>\\n' (or the empty think block the template writes
    when the turn has no reasoning) follows the generation prompt: the model must write it, so it is ACTION."""
    msgs = conversations()[-1][:-1] + [{"role": "assistant", "content": reasoning + "ok"}]
    ids, roles = labels.render(qwen3_tokenizer, msgs)
    end = max(i for i, r in enumerate(roles) if r == A) + 1
    start = max(i for i, r in enumerate(roles[:end]) if r != A) + 1  # the final turn's first ACTION token
    prompt = qwen3_tokenizer.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
    assert qwen3_tokenizer.decode(ids[:start]) == prompt and prompt.endswith("<|im_start|>assistant\n")
    want = "<think>\nfinal\n</think>\n\nok<|im_end|>" if reasoning else "<think>\n\n</think>\n\nok<|im_end|>"
    assert qwen3_tokenizer.decode(ids[start:end]) == want and qwen3_tokenizer.decode(ids[end:]) == "\n"


def test_end_of_turn_token_special_only_in_the_vocabulary(tokenizer):
    tok = with_template(tokenizer, "phi3")
    assert "<|end|>" not in tok.all_special_tokens and tok.eos_token == "<|endoftext|>"
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ls"},
            {"role": "user", "content": "a.txt"}]
    ids, roles = labels.render(tok, msgs)
    assert [tok.decode([i]) for i, r in zip(ids, roles) if r == A] == ["ls", "<|end|>"]
    assert [tok.decode([i]) for i, r in zip(ids, roles) if r == O] == ["a", ".txt", "<|end|>"]
    with pytest.raises(ValueError, match="special token '<\\|end\\|>'"):
        labels.render(tok, msgs + [{"role": "assistant", "content": "done<|end|>"}])


def test_defuse_specials(tokenizer):
    """Every special token string is broken, visibly and the same way each time; other text is untouched."""
    specials = labels.special_tokens(tokenizer)
    assert "<|im_end|>" in specials and "<|endoftext|>" in specials
    plain = "root@box:/app# ls\n<im_end> | <|x|> 'quoted' \u00e9\n"
    assert labels.defuse_specials(tokenizer, plain) == plain
    text = "".join(f"a {t} b {t}{t}" for t in specials) + "<<|im_start|>>"
    safe = labels.defuse_specials(tokenizer, text)
    assert not any(t in safe for t in specials)
    assert safe.replace(labels.ESCAPE, "") == text and safe.count(labels.ESCAPE) == 3 * len(specials) + 1
    assert labels.defuse_specials(tokenizer, safe) == safe
    assert "<\u200b|im_end|>" in safe
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ls"},
            {"role": "user", "content": safe}]
    ids, roles = labels.render(tokenizer, msgs)  # encode accepts it; only the template's own end-of-turns remain
    assert ids.count(tokenizer.convert_tokens_to_ids(EOT)) == 3


def test_straddling_token_takes_highest_priority_role(tokenizer):
    tok = labels.load_tokenizer(tokenizer.name_or_path, "native")
    tok.chat_template = PLAIN_TEMPLATE
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": '{"a": 1}'},
            {"role": "user", "content": "out: $"}]
    ids, roles = labels.render(tok, msgs)
    text = tok.apply_chat_template(msgs, tokenize=False)
    pieces = [(text[a:b], r) for (a, b), r in zip(tok(text, add_special_tokens=False,
                                                      return_offsets_mapping=True)["offset_mapping"], roles)]
    # '}' ends the action and '\n\n' is template text: the pre-tokenizer keeps them in one token
    assert ("}\n\n", A) in pieces
    assert [t for t, r in pieces if r == A] == ['{', '"', 'a', '":', ' ', '1', '}\n\n']
    assert "".join(t for t, r in pieces if r == O) == "out: $"  # '$' and '\n\n' are separate tokens here


@pytest.mark.parametrize("cut", [1, 5, 40, 97])
def test_max_len_truncation_keeps_roles_aligned(tokenizer, cut):
    msgs = nemotron_rows()[1]["conversations"]
    ids, roles = labels.render(tokenizer, msgs)
    tids, troles = labels.render(tokenizer, msgs, max_len=cut)
    assert tids == ids[:cut] and troles == roles[:cut]


def test_prefix_template_is_prefix_preserving(tokenizer):
    for msgs in conversations():
        for k in range(1, len(msgs)):
            a, ra = labels.render(tokenizer, msgs[:k])
            b, rb = labels.render(tokenizer, msgs[: k + 1])
            assert b[: len(a)] == a and rb[: len(ra)] == ra
            if msgs[k]["role"] == "assistant":  # what a policy sees before generating this turn
                g = tokenizer.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=True)
                assert tokenizer.apply_chat_template(msgs[: k + 1], tokenize=False).startswith(g)


def test_native_qwen3_template_is_not_prefix_preserving(qwen3_tokenizer):
    msgs = nemotron_rows()[0]["conversations"]
    a, _ = labels.render(qwen3_tokenizer, msgs[:2])
    b, _ = labels.render(qwen3_tokenizer, msgs[:4])
    assert b[: len(a)] != a  # earlier reasoning is stripped: why 'prefix' is the default


def test_template_choice_is_saved_with_the_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    again = labels.load_tokenizer(tmp_path, "native")
    assert again.chat_template == labels.PREFIX_TEMPLATE


def test_a_missing_checkpoint_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'final'}: no such checkpoint folder"):
        labels.load_tokenizer(tmp_path / "final")


def test_message_labels():
    msgs = [{"role": r, "content": ""} for r in ["system", "user", "assistant", "user", "assistant", "tool", "user"]]
    assert labels.message_labels(msgs) == [P, P, A, O, A, O, O]


def test_nemotron_rows_load_as_is(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in nemotron_rows()))
    convs, bad = labels.read_trajectories(path)
    assert bad == 0 and len(convs) == 3 and [len(c) for c in convs] == [16, 12, 10]
    convs_json, _ = labels.read_trajectories(_as_json(tmp_path))
    assert convs_json == convs


def test_nemotron_rows_load_from_parquet_through_datasets(tmp_path):
    """The corpus as the hub publishes it (parquet), read through the `datasets` library as sft.py --data does:
    the same conversations as the JSON rows, and errors that name the row."""
    import datasets
    rows = nemotron_rows()
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    where = []
    convs, bad = labels.read_trajectories(tmp_path / "rows.parquet", where=where)
    assert (convs, bad) == (labels.read_trajectories(_as_json(tmp_path))[0], 0)
    assert where == [f"{tmp_path}/rows.parquet: row {i}" for i in range(3)]
    rows[1]["conversations"][2]["role"] = "robot"
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=r"bad.parquet: row 1: conversations\[2\].role: unknown role 'robot'"):
        labels.read_trajectories(tmp_path / "bad.parquet")
    assert labels.read_trajectories(tmp_path / "bad.parquet", skip_bad=True)[1] == 1


def _as_json(tmp_path):
    p = tmp_path / "rows.json"
    p.write_text(json.dumps(nemotron_rows()))
    return p


BAD = [
    ('{"conversations": [{"role": "user", "content": "hi"}', "rows.jsonl:2: invalid JSON"),
    ('{"conversations": [{"content": "hi"}]}', "rows.jsonl:2: conversations[0]: missing field 'role'"),
    ('{"messages": [{"role": "user"}]}', "rows.jsonl:2: messages[0]: missing field 'content'"),
    ('{"conversations": [{"role": "robot", "content": "hi"}]}',
     "rows.jsonl:2: conversations[0].role: unknown role 'robot'"),
    ('{"conversations": [{"role": "user", "content": 3}]}',
     "rows.jsonl:2: conversations[0].content: expected a string, got int"),
    ('{"text": "hi"}', "rows.jsonl:2: missing field 'conversations'"),
    ('{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "ls"}]}]}',
     "rows.jsonl:2: messages[0].tool_calls: not supported"),
]


@pytest.mark.parametrize("line,msg", BAD)
def test_bad_rows_name_file_line_and_field(tmp_path, line, msg):
    good = json.dumps({"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    path = tmp_path / "rows.jsonl"
    path.write_text(good + "\n" + line + "\n" + good + "\n")
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        labels.read_trajectories(path)
    convs, bad = labels.read_trajectories(path, skip_bad=True)
    assert (len(convs), bad) == (2, 1)
