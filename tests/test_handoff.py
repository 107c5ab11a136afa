"""The hand-off at the context limit on messages (handoff.py): the unwinding, the calls' contexts, the context after
each way it can end (the full hand-off and its fallbacks), the terminal the hand-off shows, and an episode's contexts
and segments around its hand-offs (episode.py). The engine's runs of it: tests/test_engine.py."""
import pytest

from actobs import episode, handoff, terminus
from actobs.episode import Episode, Handoff


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def count(messages):
    """A token count for the tests: a token a character."""
    return sum(len(m["content"]) for m in messages)


PROMPT = "P" * 100  # the first prompt
# the context when it is full: the prompt, then replies and observations of 10 characters, the last observation that
# did not fit
CONTEXT = [user(PROMPT)] + [m for i in range(1, 5) for m in (bot(f"reply {i:04d}"), user(f"obs {i:06d}"))]


def test_unwind_drops_the_last_two_messages_until_the_rest_fits_and_keeps_the_prompt():
    history = CONTEXT[:-1]  # 8 messages: the prompt, 4 replies, 3 observations (the last one did not fit)
    assert count(history) == 170
    assert handoff.unwind(history, count, 170) == 8  # fits as it is
    assert handoff.unwind(history, count, 169) == 6  # the last observation and reply dropped
    assert handoff.unwind(history, count, 130) == 4
    assert handoff.unwind(history, count, 110) == 2  # the prompt and the first reply
    assert handoff.unwind(history, count, 109) == 1  # an even length: the last step drops one, never the prompt
    assert handoff.unwind(history, count, -5) == 1  # the prompt stays however little room is left
    assert handoff.unwind(history[:7], count, 100) == 1


def drive(gen, replies):
    """Run a hand-off generator, sending each call the reply `replies` gives its name (None: the call failed).
    -> (the calls in order, the Outcome)."""
    calls, sent = [], None
    while True:
        try:
            call = gen.send(sent)
        except StopIteration as done:
            return calls, done.value
        calls.append(call)
        sent = replies[call.name]


def hand_off(max_len):
    return handoff.hand_off(CONTEXT, "Fix it.", "$ ls\nout.txt", count, max_len)


def test_the_full_hand_off_calls_and_the_context_after(monkeypatch):
    """The history unwound to max_len - UNWIND_FREE (here the prompt and the first exchange); the summary on it, the
    questions on a context of their own, the answers on the history with the summary; the context after: the first
    prompt, the questions' prompt and the questions, then the answers in the hand-off's prompt."""
    monkeypatch.setattr(handoff, "UNWIND_FREE", 900)
    calls, out = drive(hand_off(1020), {"summary": "S", "questions": "Q?", "answers": "A."})
    kept = CONTEXT[:2]  # 110 characters: at most 1020 - 900
    ask_summary = user(handoff.HANDOFF_SUMMARY.format(instruction="Fix it."))
    ask_questions = user(handoff.HANDOFF_QUESTIONS.format(instruction="Fix it.", summary="S", screen="$ ls\nout.txt"))
    assert [c.name for c in calls] == ["summary", "questions", "answers"]
    assert calls[0].messages == kept + [ask_summary]
    assert calls[1].messages == [ask_questions]
    assert calls[2].messages == kept + [ask_summary, bot("S"), user(handoff.HANDOFF_ANSWERS.format(questions="Q?"))]
    assert out == handoff.Outcome(2, "summary", [user(PROMPT), ask_questions, bot("Q?"),
                                                 user(handoff.HANDOFF.format(answers="A."))])


@pytest.mark.parametrize("failed", ["summary", "questions", "answers"])
def test_a_failed_call_falls_back_to_a_short_summary(failed):
    """Any of the three calls failing (its prompt did not fit, or it was cut) ends the full hand-off where it failed:
    one bare call for a short summary (the task and the terminal's tail), the context after it the unwound history
    and the note."""
    replies = {"summary": "S", "questions": "Q?", "answers": "A.", "short": "Do X then Y.", failed: None}
    calls, out = drive(hand_off(1000), replies)
    names = ["summary", "questions", "answers"]
    assert [c.name for c in calls] == names[:names.index(failed) + 1] + ["short"]
    tail = "$ ls\nout.txt"
    assert calls[-1].messages == [user(handoff.HANDOFF_SHORT.format(instruction="Fix it.", screen=tail))]
    assert out == handoff.Outcome(1, "short", [user(PROMPT), user(handoff.HANDOFF_NOTE.format(
        instruction="Fix it.", summary="Do X then Y."))])


def test_a_context_after_that_does_not_fit_falls_back_in_turn():
    """The full hand-off's context after does not fit (long answers): the short summary; its context does not fit
    either (a long summary): the task and the terminal, no call; and when not even that fits, no context."""
    long = "x" * 2000
    note = handoff.HANDOFF_NOTE.format(instruction="Fix it.", summary="short")
    need = count([user(PROMPT), user(note)])
    calls, out = drive(hand_off(need + 1), {"summary": "S", "questions": "Q?", "answers": long, "short": "short"})
    assert [c.name for c in calls] == ["summary", "questions", "answers", "short"] and out.fallback == "short"
    state = [user(PROMPT), user(handoff.HANDOFF_STATE.format(instruction="Fix it.", screen="$ ls\nout.txt"))]
    calls, out = drive(hand_off(count(state) + 1), {"summary": None, "short": long})
    assert out == handoff.Outcome(1, "state", state)
    calls, out = drive(hand_off(count(state)), {"summary": None, "short": None})  # room for no token of reply
    assert out == handoff.Outcome(1, None, None) and [c.name for c in calls] == ["summary", "short"]


def test_the_fallbacks_show_the_terminals_last_characters():
    screen = "\n".join(f"line {i}" for i in range(400))
    _, out = drive(handoff.hand_off(CONTEXT, "Fix it.", screen, count, 10_000), {"summary": None, "short": None})
    assert out.context[-1]["content"] == handoff.HANDOFF_STATE.format(instruction="Fix it.",
                                                                      screen=screen[-handoff.SCREEN_TAIL:])


def test_the_screen_is_the_latest_terminal_text():
    """The terminal the hand-off shows: the last screen rows of the latest observation that shows the terminal (its
    new output, inside warnings or the completion check too); a parse error or a cut reply's answer shows none, so
    an earlier one counts, down to the first prompt's screen."""
    first = terminus.fill_prompt(terminus.DEFAULT_PROMPT, "Fix it.", terminus.SCREEN_HEADER + "root@box:/app# \n")
    msgs = [user(first), bot("r1"), user(terminus.parse_error_message("bad", [])), bot("r2"),
            user(terminus.cut_message(64, []))]
    assert handoff.latest_screen(msgs) == "root@box:/app# "
    out = "\n".join(f"row {i}" for i in range(100))
    for obs in (terminus.OUTPUT_HEADER + out, terminus.with_warnings(terminus.OUTPUT_HEADER + out, ["w"]),
                terminus.confirm_message(terminus.OUTPUT_HEADER + out)):
        assert handoff.latest_screen(msgs + [bot("r3"), user(obs)] + msgs[2:]) == "\n".join(
            f"row {i}" for i in range(60, 100))
    assert terminus.terminal_text(terminus.parse_error_message("bad", [])) is None
    assert terminus.terminal_text("no terminal here") is None


def test_contexts_and_segments_around_hand_offs():
    """An episode handed off twice: three contexts, each the messages the policy saw there (the hand-off's context,
    then the messages after it), and three token segments; a failed last hand-off adds none."""
    msgs = [user("P"), bot("a"), user("o1"), bot("b"), user("o2"), bot("c"), user("o3"), bot("d")]
    h1 = Handoff(at=3, kept=1, fallback="summary", context=[user("P"), user("Q"), bot("q"), user("A")], start=10)
    h2 = Handoff(at=5, kept=1, fallback="state", context=[user("P"), user("S")], start=18)
    ep = Episode("t", msgs, token_ids=list(range(25)), handoffs=[h1, h2])
    assert episode.contexts(ep) == [msgs[:3], h1.context + msgs[3:5], h2.context + msgs[5:]]
    assert episode.segments(ep) == [(0, 10), (10, 18), (18, 25)]
    ep.handoffs.append(Handoff(at=8, kept=1, fallback=None))
    assert episode.segments(ep) == [(0, 10), (10, 18), (18, 25)] and len(episode.contexts(ep)) == 3
    assert episode.handed_off(ep) == [h1, h2]
