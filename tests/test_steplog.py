"""steplog.py's transcripts: which of a step's episodes are written, what a transcript holds, and which files a
report links. Pure: episodes are stand-ins with the fields episode.Episode has."""
import subprocess
from pathlib import Path
import sys
from types import SimpleNamespace

from actobs import steplog, terminus
from actobs.episode import Handoff


def episode(task, reward, failure=None, replies=("{}",), truncated=False):
    """An Episode's fields the transcripts read: each reply answered by an observation, but the last."""
    messages = [{"role": "user", "content": f"Solve {task}."}]
    for k, r in enumerate(replies):
        messages.append({"role": "assistant", "content": r})
        if k + 1 < len(replies):
            messages.append({"role": "user", "content": f"output {k + 1}"})
    return SimpleNamespace(task=task, reward=reward, failure=failure, truncated=truncated, turns=len(replies),
                           messages=messages, handoffs=[])


def test_a_step_writes_a_solved_and_a_failed_episode_of_one_group(tmp_path):
    """Groups of 3: the first has only failures, one lost to the infrastructure; the second a solved and a failed
    episode; the third more of each. The transcript is of the second group's pair, in full, in turn order."""
    eps = [episode("a", 0.0), episode("a", 0.0, failure="sandbox_error"), episode("a", 0.0),
           episode("b", 0.0, failure="max_turns", replies=("{x", "{y")), episode("b", 1.0, replies=("ls", "done")),
           episode("b", 1.0), episode("c", 1.0), episode("c", 0.0), episode("c", 0.0)]
    adv = [0.0] * 3 + [-2 / 3, 1 / 3, 1 / 3] + [2 / 3, -1 / 3, -1 / 3]
    assert steplog.chosen_episodes(eps, 3) == [4, 3]
    path = steplog.write_transcripts(tmp_path / "transcripts", 3, eps, adv, 3)
    assert path == tmp_path / "transcripts" / "step_0003.md"
    text = path.read_text()
    assert text.startswith("# Step 3: 2 of the 9 episodes rank 0 ran\n")
    solved, failed = text.index("## solved: b, reward 1.00, advantage +0.333, 2 turns, ended by the agent"), \
        text.index("## failed: b, reward 0.00, advantage -0.667, 2 turns, max_turns")
    assert solved < failed and text.count("\n## ") == 2
    sections = ["### prompt", "Solve b.", "### reply 1", "ls", "### observation 1", "output 1", "### reply 2", "done"]
    at = [text.index(s, solved) for s in sections]
    assert at == sorted(at) and at[-1] < failed


def test_a_step_without_one_kind_writes_what_it_has(tmp_path):
    """No group with both: the first solved and the first failed episode; none solved: a failed one alone; only
    infrastructure failures: a file that says so. A long reply is cut to its head and tail."""
    long = "x" * 3000 + "END"
    eps = [episode("a", 1.0), episode("a", 1.0), episode("b", 0.0, replies=(long,)), episode("b", 0.0)]
    assert steplog.chosen_episodes(eps, 2) == [0, 2]
    assert steplog.chosen_episodes(eps[2:], 2) == [0]
    text = steplog.write_transcripts(tmp_path, 1, eps, [0.0] * 4, 2).read_text()
    assert terminus.truncate_output(long, steplog.MAX_TEXT) in text and "END" in text and "x" * 2500 not in text
    lost = [episode("a", 0.0, failure="image_build_error")] * 2
    assert steplog.write_transcripts(tmp_path, 2, lost, [0.0] * 2, 2).read_text().endswith(
        "No episode ended solved or failed.\n")


def test_a_handed_off_episode_shows_each_hand_off_where_it_happened():
    """An episode handed off after its second observation (the full hand-off) and at its end (nothing fit): each
    hand-off follows the observation that did not fit, with its calls' replies and the context the next replies
    answer (the first prompt named, not repeated); the heading counts the hand-offs the episode went on after."""
    ep = episode("b", 0.0, failure="max_len", replies=("r1", "r2", "r3", "r4"), truncated=True)
    ep.messages.append({"role": "user", "content": "output 4"})
    calls = [{"name": n, "prompt_tokens": 700 + k, "reply": f"{n} reply", "reply_tokens": 5, "finish": "stop"}
             for k, n in enumerate(("summary", "questions", "answers"))]
    ep.handoffs = [
        Handoff(at=5, kept=1, calls=calls, fallback="summary", start=800, seconds=1.5,
                context=[ep.messages[0], {"role": "user", "content": "the questions' prompt"},
                         {"role": "assistant", "content": "questions reply"},
                         {"role": "user", "content": "the answers' prompt"}]),
        Handoff(at=9, kept=3, fallback=None, calls=[{"name": "summary", "prompt_tokens": 900, "reply": "",
                                                     "reply_tokens": 0, "finish": "no room"}])]
    text = steplog.transcript(ep, -0.5)
    assert text.startswith("## failed: b, reward 0.00, advantage -0.500, 4 turns, 1 hand-off, max_len\n")
    sections = ["### observation 2", "output 2", f"### hand-off 1: {steplog.FALLBACKS['summary']}",
                "kept the first message", "1.5s", "the replies after this answer the new context.",
                "#### summary call: 700 prompt tokens, reply 5 tokens (stop)", "summary reply",
                "#### questions call: 701 prompt tokens", "questions reply", "#### answers call", "answers reply",
                "#### new context, message 1 (user)", "(the prompt above)",
                "#### new context, message 2 (user)", "the questions' prompt",
                "#### new context, message 3 (assistant)", "questions reply",
                "#### new context, message 4 (user)", "the answers' prompt", "### reply 3", "r3",
                "### observation 4", "output 4", f"### hand-off 2: {steplog.FALLBACKS[None]}", "its first 3 messages",
                "no context fit, and the episode ended.",
                "#### summary call: 900 prompt tokens, reply 0 tokens (no room)"]
    at = 0
    for s in sections:  # each after the one before
        at = text.index(s, at)
    assert text.count("### hand-off") == 2 and text.count("Solve b.") == 1


def test_pick_transcripts_takes_the_last_step_with_each_kind(tmp_path):
    """The report's links: the last step's file with a solved episode, and with a failed one; none of a kind: absent."""
    assert steplog.pick_transcripts(tmp_path) == {}
    steplog.write_transcripts(tmp_path, 1, [episode("a", 1.0), episode("a", 0.0)], [0.5, -0.5], 2)
    steplog.write_transcripts(tmp_path, 2, [episode("a", 0.0), episode("a", 0.0)], [0.0, 0.0], 2)
    steplog.write_transcripts(tmp_path, 10, [episode("a", 0.0, failure="sandbox_error")], [0.0], 1)
    assert steplog.pick_transcripts(tmp_path) == {"solved": tmp_path / "step_0001.md",
                                                 "failed": tmp_path / "step_0002.md"}
    only_solved = tmp_path / "solved"
    steplog.write_transcripts(only_solved, 1, [episode("a", 1.0)], [0.0], 1)
    assert steplog.pick_transcripts(only_solved) == {"solved": only_solved / "step_0001.md"}


def test_import_needs_no_torch():
    """scripts/report.py imports steplog for pick_transcripts: no torch (nor vLLM) at import."""
    code = "import sys; from actobs import steplog; assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(steplog.__file__).parents[1])
