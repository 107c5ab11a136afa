"""
The hand-off at the context limit, as Harbor's Terminus-2 summarises a conversation that no longer fits its model's
context: the context is unwound (its last exchanges dropped until UNWIND_FREE tokens are free), the policy
writes a hand-over note on that history, a fresh context of it asks the questions the note leaves open, the history
answers them, and the episode goes on in a new context: the first prompt, the questions and the answers. When a call
does not fit or is cut at the reply's token limit, a short summary from one bare call stands in; failing that, the
task and the terminal alone; when not even that fits, nothing does.

hand_off is the procedure on messages, a generator: it yields each model call (Call: its messages) and is sent the
call's reply, so that engine.VLLMPolicy runs the calls as engine requests among the other episodes' turns. Pure: no
engine, no tokenizer (the token count of a list of messages is passed in). docs/sandboxes.md#the-hand-off-at-the-
context-limit; what GRPO trains of a handed-off episode: docs/training.md#a-handed-off-episode.
"""
import dataclasses

from actobs import terminus
from actobs.sandbox.sandbox import SCREEN

# The prompts. The words are written here for this project, not Harbor's text; each prompt has the purpose and the
# structure of Terminus-2's. The calls: a hand-over note on the (unwound) history; in a fresh context the next
# agent's questions about it, given the task, the note and the terminal; the answers on the history. The context after
# the hand-off: the first prompt, HANDOFF_QUESTIONS and its questions, then HANDOFF with the answers.
HANDOFF_SUMMARY = ("Your context is full: another agent will carry on with this task in your place. Write it a "
                   "hand-over note.\n\nThe task:\n{instruction}\n\nFrom the conversation so far, set out in "
                   "detail:\n1. The actions you took: every command that mattered and what it showed you.\n"
                   "2. What you found out: files and where they are, settings, error messages, the state of the "
                   "system.\n3. The problems you ran into and how you got past them.\n4. Where the task stands: "
                   "what is done and what is left to do.\n\nLeave nothing out: the next agent will know only what "
                   "this note says.")
HANDOFF_QUESTIONS = ("You are taking over a task that another agent started.\n\nThe task:\n{instruction}\n\n"
                     "The other agent's hand-over note:\n{summary}\n\nThe terminal now:\n{screen}\n\nBefore "
                     "you carry on, ask the other agent about the state of the work where its note leaves you "
                     "unsure: at least five questions, more if you need them. After its answers you are on your "
                     "own, so ask for everything you need to know.")
HANDOFF_ANSWERS = ("The agent taking over from you asks the questions below. Answer every one of them, in turn and "
                   "in detail:\n\n{questions}")
HANDOFF = ("The other agent's answers:\n\n{answers}\n\nCarry on with the task from the point where it stopped. "
           "You can ask no more questions; reply in the format the task's instructions give.")
# The fallbacks, when a call does not fit the context or is cut at the reply's token limit: a short summary from one
# call that sees only HANDOFF_SHORT, the context after it the unwound history and HANDOFF_NOTE; failing that, no
# call, the unwound history and HANDOFF_STATE. Both show the terminal's last SCREEN_TAIL characters.
HANDOFF_SHORT = ("Carry on with this task: {instruction}\n\nThe terminal now: {screen}\n\nWhat are the next "
                 "steps? Two or three sentences:")
HANDOFF_NOTE = "{instruction}\n\nWhere the work stands: {summary}"
HANDOFF_STATE = "{instruction}\n\nThe terminal now: {screen}"
SCREEN_TAIL = 1000
UNWIND_FREE = 4000  # tokens the unwinding frees in the context before the calls (Terminus-2's)


@dataclasses.dataclass(frozen=True)
class Call:
    name: str  # "summary", "questions", "answers" (the hand-off's), "short" (the first fallback's)
    messages: list  # the call's context, rendered fresh by the chat template; its reply is sampled after it


@dataclasses.dataclass(frozen=True)
class Outcome:
    kept: int  # the messages of the context before the hand-off that the unwinding kept
    fallback: str | None  # "summary", "short", "state", or None: no context fit
    context: list | None  # the context the episode goes on in (its next reply is sampled after it), or None


def unwind(history, count, limit):
    """How many of history's first messages stay: its last two messages are dropped in turn (an observation and the
    reply before it, or a reply and its observation) until count(the rest) <= limit, the first message (the task's
    prompt) kept whatever its count. (Terminus-2's loop stops at one message left; on a history of even length it can
    drop the first message too and then hand the model the bare instruction: here the prompt always stays.)"""
    n = len(history)
    while n > 1 and count(history[:n]) > limit:
        n = max(1, n - 2)
    return n


def latest_screen(messages, rows=SCREEN[1]):
    """The terminal as the hand-off shows it: the last `rows` lines (the sandbox's screen height) of the latest
    terminal text among the user messages (terminus.terminal_text: an observation's new output or screen, else the
    first prompt's screen). Terminus-2 captures the visible screen at the moment of the hand-off: the policy has no
    sandbox, so this is the terminal the agent was last shown (its last output, not the rows above it)."""
    for m in reversed(messages):
        text = terminus.terminal_text(m["content"]) if m["role"] == "user" else None
        if text is not None:
            return "\n".join(text.strip("\n").split("\n")[-rows:])
    return ""


def user(text):
    return {"role": "user", "content": text}


def hand_off(context, instruction, screen, count, max_len):
    """The hand-off of a context that is full (its last message, an observation, left no room for a reply), as a
    generator: it yields each Call and is sent back the call's reply (its content, terminus.reply_content) or None
    where the call failed (its prompt did not fit in max_len, or its reply was cut at the reply's token limit, as
    Terminus-2's calls fail); it returns the Outcome. instruction: the task's; screen: latest_screen's;
    count(messages): the tokens of a context of those messages up to the reply's header; a new context fits when
    it leaves room for one token of reply.

    The full hand-off: the history (the context but the observation that did not fit, never shown) unwound to
    max_len - UNWIND_FREE tokens; summary on [history, HANDOFF_SUMMARY]; questions on [HANDOFF_QUESTIONS] alone
    (the task, the summary, the screen); answers on [history, HANDOFF_SUMMARY, summary, HANDOFF_ANSWERS]; the new
    context [first prompt, HANDOFF_QUESTIONS, questions, HANDOFF]. Any call failing, or a new context that does not
    fit: the short summary, on [HANDOFF_SHORT] alone, the new context [history, HANDOFF_NOTE]; then [history,
    HANDOFF_STATE], with no call."""
    history = context[:-1]
    kept = history[:unwind(history, count, max_len - UNWIND_FREE)]
    ask_summary = user(HANDOFF_SUMMARY.format(instruction=instruction))
    summary = yield Call("summary", kept + [ask_summary])
    if summary is not None:
        ask_questions = user(HANDOFF_QUESTIONS.format(instruction=instruction, summary=summary,
                                                               screen=screen))
        questions = yield Call("questions", [ask_questions])
        if questions is not None:
            answers = yield Call("answers", kept + [ask_summary, {"role": "assistant", "content": summary},
                                                    user(HANDOFF_ANSWERS.format(questions=questions))])
            if answers is not None:
                new = [context[0], ask_questions, {"role": "assistant", "content": questions},
                       user(HANDOFF.format(answers=answers))]
                if count(new) < max_len:
                    return Outcome(len(kept), "summary", new)
    tail = screen[-SCREEN_TAIL:]
    short = yield Call("short", [user(HANDOFF_SHORT.format(instruction=instruction, screen=tail))])
    if short is not None:
        new = kept + [user(HANDOFF_NOTE.format(instruction=instruction, summary=short))]
        if count(new) < max_len:
            return Outcome(len(kept), "short", new)
    new = kept + [user(HANDOFF_STATE.format(instruction=instruction, screen=tail))]
    return Outcome(len(kept), "state", new) if count(new) < max_len else Outcome(len(kept), None, None)
