"""
Trajectories in, labelled tokens out: the part of ActObs that SFT, probes, rollouts and evaluation share.

    convs, n_bad = read_trajectories("data.jsonl")            # errors name file, line and field
    convs, n_bad = read_trajectories("nvidia/Nemotron-Terminal-Corpus")   # or a parquet file: `datasets`
    tok = load_tokenizer("Qwen/Qwen3-4B", "prefix")           # the chat template everything will use
    ids, roles = render(tok, convs[0], max_len=16384)         # one role per token: PROMPT, ACTION, OBS

render() labels exactly, for any chat template, by what the policy generates: an assistant turn is ACTION
from the end of the template's generation prompt up to and including its end-of-turn token; a later user or
tool turn is OBS (its content and end-of-turn token); system and first user turn, and headers, are PROMPT.
The default 'prefix' template renders turn by turn, as a policy sees them at RL and evaluation time.
"""
import json
import os
from pathlib import Path

import numpy as np

PROMPT, ACTION, OBS = 0, 1, 2  # per-token roles; only ACTION and OBS tokens carry loss

VALID_ROLES = ("system", "user", "assistant", "tool")


def check_row(row, where):
    """A row's conversation ({"conversations" or "messages": [{role, content}]}), checked; a bad row raises naming
    `where` and the field."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with 'conversations' or 'messages', got {type(row).__name__}")
    key = "conversations" if "conversations" in row else "messages" if "messages" in row else None
    if key is None:
        raise ValueError(f"{where}: missing field 'conversations' (or 'messages')")
    msgs = row[key]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: field '{key}' must be a non-empty list")
    for i, m in enumerate(msgs):
        field = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: {field}: expected an object with 'role' and 'content'")
        for k in ("role", "content"):
            if k not in m:
                raise ValueError(f"{where}: {field}: missing field '{k}'")
        if m["role"] not in VALID_ROLES:
            raise ValueError(f"{where}: {field}.role: unknown role {m['role']!r} "
                             f"(expected one of {', '.join(VALID_ROLES)})")
        if not isinstance(m["content"], str):
            raise ValueError(f"{where}: {field}.content: expected a string, got {type(m['content']).__name__}")
        for k in ("tool_calls", "reasoning_content"):  # dropping them would silently lose the action
            if m.get(k):
                raise ValueError(f"{where}: {field}.{k}: not supported; put the whole turn in 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def dataset_rows(source):
    """[(location, row)] of a parquet file (a local path, a glob or an hf:// URL) or a Hugging Face dataset id,
    `ID[:SPLIT]` (every split when none is named), through the `datasets` library (imported only here)."""
    import datasets
    if source.endswith(".parquet"):
        return [(f"{source}: row {i}", r) for i, r in
                enumerate(datasets.load_dataset("parquet", data_files=source, split="train"))]
    name, _, split = source.partition(":")
    parts = datasets.load_dataset(name)
    if split and split not in parts:
        raise ValueError(f"{name}: no split {split!r} (it has {', '.join(parts)})")
    return [(f"{name}[{s}]: row {i}", r) for s in ([split] if split else parts) for i, r in enumerate(parts[s])]


def write_jsonl(path, rows):
    """rows (dicts) as a JSONL file, written to a temp name, then renamed: a killed run never leaves a truncated
    file that looks complete."""
    tmp = Path(f"{path}.tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_trajectories(path, skip_bad=False, where=None):
    """-> (list of message lists, number of bad rows skipped) from a JSONL file, a JSON array, or what
    dataset_rows reads (a parquet file, a Hugging Face dataset id). Errors name the file, line (row) and field;
    a list passed as `where` receives each kept trajectory's location ('file:line') for later errors."""
    path = str(path)
    rows, convs, bad = [], [], 0
    if path.endswith(".parquet") or not (path.endswith((".json", ".jsonl")) or os.path.exists(path)):
        rows = dataset_rows(path)
    else:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".json"):  # a JSON array of rows, e.g. a dataset sample file
                rows = [(f"{path}: row {i}", r) for i, r in enumerate(json.load(f))]
            else:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rows.append((f"{path}:{lineno}", json.loads(line)))
                    except json.JSONDecodeError as e:
                        if not skip_bad:
                            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
                        bad += 1
    for loc, row in rows:
        try:
            convs.append(check_row(row, loc))
        except ValueError:
            if not skip_bad:
                raise
            bad += 1
            continue
        if where is not None:
            where.append(loc)
    return convs, bad


def message_labels(messages):
    """The token label (PROMPT / ACTION / OBS, not the chat role) of each message: system and the first user turn
    are PROMPT, assistant turns are ACTION, later user turns and tool turns are OBS (the environment's
    feedback)."""
    out, seen_user = [], False
    for m in messages:
        if m["role"] == "assistant":
            out.append(ACTION)
        elif m["role"] == "system" or (m["role"] == "user" and not seen_user):
            out.append(PROMPT)
        else:
            out.append(OBS)
        seen_user |= m["role"] == "user"
    return out


# ChatML that renders every message independently and in order, assistant contents verbatim (reasoning
# included), so render(messages[:k]) is a prefix of render(messages[:k+1]): exactly the token stream a policy
# accumulates turn by turn at RL and evaluation time. Qwen3's own template instead strips the reasoning of
# earlier turns and merges consecutive tool turns, which no rollout ever sees.
PREFIX_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def load_tokenizer(path, chat_template="prefix"):
    """The tokenizer with the chat template that training, rollouts and evaluation will all use."""
    from transformers import AutoTokenizer
    p = Path(path)  # a local folder mistyped or not written yet (runs/x/final), not a hub id (Qwen/Qwen3-4B, gpt2):
    if len(p.parts) > 1 and p.parent.is_dir() and not p.exists():  # Hugging Face would call it a bad repo id
        raise FileNotFoundError(f"{path}: no such checkpoint folder")
    tok = AutoTokenizer.from_pretrained(path)
    if chat_template == "prefix":
        if "<|im_start|>" not in tok.get_vocab():
            raise ValueError(f"{path}: --chat-template prefix is ChatML (Qwen family) but this tokenizer has no "
                             "<|im_start|> token; pass --chat-template native or a .jinja file")
        tok.chat_template = PREFIX_TEMPLATE
    elif chat_template != "native":
        tok.chat_template = Path(chat_template).read_text()
    if not tok.chat_template:
        raise ValueError(f"{path}: the tokenizer has no chat template; pass --chat-template prefix or a .jinja file")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _longest_prefix_found(piece, text, start):
    """(position, length) of the first occurrence in text[start:] of the longest prefix of `piece` found there."""
    lo, hi = 0, len(piece)  # invariant: piece[:lo] occurs; occurrence is monotone in the prefix length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.find(piece[:mid], start) >= 0:
            lo = mid
        else:
            hi = mid - 1
    return (text.find(piece[:lo], start) if lo else -1), lo


def special_tokens(tokenizer):
    """Every special token of the vocabulary: the named ones (eos, pad...) and each added token marked special
    (e.g. Phi-3's '<|end|>', which closes turns without being eos or a named special token)."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return sorted({t for t in list(tokenizer.all_special_tokens) + added if t}, key=lambda t: (-len(t), t))


# Inserted after the first character of a special token's string found in text the environment produced: the
# text then tokenises as plain characters, not as a turn boundary, and still reads the same on screen.
ESCAPE = "\u200b"  # zero-width space


def defuse_specials(tokenizer, text):
    """`text` with every special token string of the tokenizer (special_tokens) broken by ESCAPE after its first
    character, e.g. '<|im_end|>' -> '<\u200b|im_end|>'. For text an agent can make the environment print (an
    observation: `echo '<|im_end|>'`), which encode() would otherwise refuse or, unchecked, would end a turn.
    Deterministic and idempotent; text without a special token string is returned unchanged. (A one-character
    special token cannot be broken this way and is left as it is.)"""
    specials = [t for t in special_tokens(tokenizer) if len(t) > 1]
    while hit := next((t for t in specials if t in text), None):
        text = text.replace(hit, hit[0] + ESCAPE + hit[1:])
    return text


def generation_prompt(tokenizer, messages):
    """The text add_generation_prompt=True appends after `messages` ('' if the template writes none). A template
    that renders the conversation itself differently once the prompt is added is refused: neither the labels
    nor token-in/token-out rollouts could follow it."""
    from jinja2 import TemplateError
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False)
        prompted = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:  # e.g. Qwen3's template refuses a conversation without a user turn
        return ""
    if not prompted.startswith(plain):
        raise ValueError("the chat template renders a conversation differently once a generation prompt is added")
    return prompted[len(plain):]


def message_spans(tokenizer, messages, text):
    """Character ranges of each message in `text`, the text its role labels.

    An assistant turn is everything the policy generates: from the end of the template's generation prompt
    (what add_generation_prompt=True appends after the preceding messages; e.g. Qwen3's '<think>\n' after
    '<|im_start|>assistant\n' is the model's to write) up to and including its end-of-turn token. Other
    messages are their rendered content and their end-of-turn token; the template text around the content
    (headers, '\n</tool_response>') is PROMPT. With a template that has no generation prompt, an assistant
    turn is labelled like the others.

    The template is rendered once more with every content replaced by a sentinel; the template text between
    two sentinels (end-of-turn, next header) is then located in the real rendering. The end-of-turn token is
    the first special token (special_tokens) after the content, if it is one the template closes messages
    with (found in the text after the last message) or the eos token."""
    sent = [f"\ue000{j}\ue001" for j in range(len(messages))]
    skel_msgs = [{**m, "content": s} for m, s in zip(messages, sent)]
    skel = tokenizer.apply_chat_template(skel_msgs, tokenize=False)
    pieces, pos = [], 0
    for j, s in enumerate(sent):
        k = skel.find(s, pos)
        if k < 0:
            raise ValueError(f"the chat template does not render message {j} ({messages[j]['role']}); cannot label it")
        pieces.append(skel[pos:k])
        pos = k + len(s)
    pieces.append(skel[pos:])
    specials = special_tokens(tokenizer)
    closers = {t for t in specials if t in pieces[-1]} | {tokenizer.eos_token}

    def eot(piece):  # (offset, length) of the end-of-turn token in the template text after a content
        hits = [(piece.find(t), -len(t), t) for t in specials if t in piece]
        if not hits:
            return None
        k, _, t = min(hits)
        return (k, len(t)) if t in closers else None

    def generated_from(j):  # offset in pieces[j] where what the policy writes for assistant turn j begins
        g = generation_prompt(tokenizer, skel_msgs[:j]) if messages[j]["role"] == "assistant" else ""
        k = pieces[j].find(g) if g else -1
        return k + len(g) if k >= 0 else len(pieces[j])

    start = len(os.path.commonprefix([pieces[0], text]))
    begin = min(generated_from(0), start)
    spans = []
    for j in range(1, len(pieces)):
        piece = pieces[j]
        if j == len(messages):  # the template text after the last content closes the rendering
            q, n = (text.rfind(piece), len(piece)) if piece else (len(text), 0)
            if q < start or q + n != len(text):
                q = -1
        else:
            q, n = _longest_prefix_found(piece, text, start)
        if q < 0 or (n == 0 and j < len(messages)):
            raise ValueError(f"cannot find where message {j - 1} ({messages[j - 1]['role']}) ends in the rendered text")
        e = eot(piece[:n])
        if messages[j - 1]["role"] == "assistant":  # one contiguous range: all the policy writes
            spans.append([(begin, q + e[0] + e[1] if e else q)])
        else:
            spans.append([(start, q)] + ([(q + e[0], q + e[0] + e[1])] if e else []))
        start = q + n
        if j < len(messages):
            begin = q + min(generated_from(j), n)
    return spans


def render(tokenizer, messages, max_len=None):
    """-> (ids, roles): the conversation as the tokenizer's chat template renders it, one role per token.

    A message's role covers the text message_spans gives it (for an assistant turn, all it generates after the
    generation prompt; otherwise its content and end-of-turn token); headers are PROMPT. A token that a
    BPE merge makes straddle two segments takes the highest-priority role among its characters,
    ACTION > OBS > PROMPT: every character the model must produce stays supervised (at the cost of a few
    template characters in such rare merged tokens)."""
    ids, roles, _, _ = encode(tokenizer, messages, max_len)
    return ids, roles.tolist()


def encode(tokenizer, messages, max_len=None):
    """-> (ids, roles (T,) int8, text, offsets (T, 2)): render()'s labels plus the rendered text and each
    token's character span [start, end), for probes that label sub-spans of a message (a token with an empty
    span is given the character at its start)."""
    ids, roles, text, off, _ = encode_spans(tokenizer, messages, max_len)
    return ids, roles, text, off


def encode_spans(tokenizer, messages, max_len=None):
    """encode() plus the message_spans() it labelled with: (ids, roles, text, offsets, spans)."""
    specials = special_tokens(tokenizer)
    for j, m in enumerate(messages):
        hit = next((t for t in specials if t in m["content"]), None)
        if hit:  # it would tokenise as a real turn boundary, and its labels would be ambiguous
            raise ValueError(f"messages[{j}] ({m['role']}) contains the special token {hit!r}")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    char_role = np.zeros(len(text) + 1, dtype=np.int8)  # +1: a sentinel slot for empty offsets at the end
    spans = message_spans(tokenizer, messages, text)
    for ranges, r in zip(spans, message_labels(messages)):
        for s, e in ranges:
            char_role[s:e] = r
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    off = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # (T, 2) char [start, end)
    off[:, 1] = np.maximum(off[:, 1], off[:, 0] + 1)  # a token with an empty span takes the char at its start
    roles = np.zeros(len(ids), dtype=np.int8)
    for r in (OBS, ACTION):  # later assignment wins: ACTION > OBS > PROMPT
        csum = np.concatenate([[0], np.cumsum(char_role == r)])
        roles[csum[off[:, 1]] - csum[off[:, 0]] > 0] = r
    if max_len is not None:
        ids, roles, off = ids[:max_len], roles[:max_len], off[:max_len]
    return list(ids), roles, text, off, spans
