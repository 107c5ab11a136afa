"""
An episode's record, as envs.run_episodes fills it and grpo.py, evaluate.py and the step log read it: the
conversation, the reward and how it ended (the failure kinds), the token sequence a token-level policy saw and
produced, its hand-offs at the context limit (Handoff; the contexts they split it into: segments, contexts), and the
tamper evidence. docs/sandboxes.md#how-episodes-end.
"""
import dataclasses

# Failure kinds. The agent's doing (scored; the reward goes with it): timeout, parse_errors, max_turns,
# shell_exited (the verifier still scores what was done), disk_limit and pids_limit (reward 0), verifier_error
# (reward 0: the verifier timed out, wrote no reward, or its test runner never started; an agent can break its
# own checker), tampered (reward 0, strict verification only: the agent changed what the verifier loads or runs).
# Infrastructure, never the agent's doing: GRPO and evaluation leave these episodes out.
INFRA_FAILURES = frozenset({"sandbox_error", "image_build_error"})

# The reward is the number the verifier writes (verify.verify: reward.txt, or reward.json's rule), 1 for a task done, a
# fraction for one done in part where the verifier grades (taskgen's permissions_graded). GRPO's advantages and the
# mean reward in its log take it as it is; solved (the solve rate, pass@k's solved attempts, the transcripts, the SFT
# corpus) is full marks alone.
SOLVED = 1.0


def solved(reward):
    """Whether a reward is full marks: the one definition of a solved episode or attempt."""
    return reward >= SOLVED


@dataclasses.dataclass
class Handoff:
    """One hand-off at the context limit (handoff.hand_off, run by engine.VLLMPolicy): where it happened, what the
    unwinding kept, its model calls, the fallback that gave the context after it and that context."""
    at: int  # len(messages) when the context was full: messages[at - 1], that observation, was never shown (it did
    # not fit); the replies and observations from messages[at] on are in the context after the hand-off
    kept: int = 0  # how many first messages of the context before it the unwinding kept (the calls' history)
    # The model calls in order, each {"name": summary / questions / answers / short, "prompt_tokens", "reply" (the
    # text sampled), "reply_tokens", "finish": "stop"; "length" (cut at its token limit) or "no room" (its prompt did
    # not fit): failed}. They are not trained (docs/training.md#a-handed-off-episode)
    calls: list = dataclasses.field(default_factory=list)
    fallback: str | None = None  # "summary" (the three calls), "short", "state"; None: no context fit (max_len)
    context: list = dataclasses.field(default_factory=list)  # the context after it (messages), [] when none fit
    start: int | None = None  # where that context's tokens begin in token_ids (None when none fit)
    seconds: float = 0.0  # from the full context to the reply queued in the new one


@dataclasses.dataclass
class Episode:
    task: str
    # Nemotron form: user (prompt), then assistant / user (observation) turns, every one in order, across hand-offs
    # (what each context held: contexts())
    messages: list
    reward: float = 0.0
    turns: int = 0
    failure: str | None = None  # None or a failure kind (above; max_len: the policy's context was full)
    error: str = ""  # details of the failure
    verifier_output: str = ""  # the tail of tests/test.sh's output, whenever it ran
    # Set when the reward is below 1 in a sandbox without the network (its task allows it; the run gave none) and
    # a command failed for want of it: the line that says so (the solution's or the agent's output, or that of a
    # verifier that never ran its tests). Not a failure kind: the reward stands, the run reports these apart.
    needs_network: str = ""
    # With second_try (aider's harness): the reward of the first verification; `reward` is the final one.
    first_reward: float | None = None
    # start_s, env_s (terminal steps), policy_s (waits for its own replies), verify_s, total_s
    timings: dict = dataclasses.field(default_factory=dict)
    instruction: str = ""  # the task's, as its prompt shows it (a hand-off's prompts repeat it)
    # Filled by token-level policies (engine.VLLMPolicy): the append-only sequence the policy saw and produced, one
    # context after another where it handed off (segments), one label per token (labels.PROMPT / ACTION / OBS), the
    # behaviour log-prob of each token (0.0 where not sampled), which OBS tokens are the protocol's fixed wrapper
    # text, and whether the context length cut the episode (then its messages end with the last observation).
    token_ids: list = dataclasses.field(default_factory=list)
    roles: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    obs_wrapper: list = dataclasses.field(default_factory=list)
    truncated: bool = False
    # Under a grammar (engine.VLLMPolicy): the distinct masks the replies were sampled under (packed bits) and, per
    # token, its mask's index in them, -1 where nothing was masked.
    masks: list = dataclasses.field(default_factory=list)
    mask_ids: list = dataclasses.field(default_factory=list)
    # The hand-offs at the context limit (engine.VLLMPolicy with summarize): a Handoff each, the last one failed
    # (fallback None) where the episode then ended at max_len
    handoffs: list = dataclasses.field(default_factory=list)
    # Replies that reached the policy's max_new_tokens (under a grammar the engine closed each: grammar.close_reply)
    cut_replies: int = 0
    # Tamper evidence: the verifier-loaded files the agent wrote (verify.prepare_verifier: anything in /tests, a
    # conftest.py or pytest ini in /, Python start-up hooks, pytest plugin registrations, the stand-in's uv and
    # wheels) and the verifier's programs it changed (verify.program_changes). Under strict verification the episode
    # then ends as `tampered`, reward 0; otherwise the verifier ran without the planted inputs where it could, and
    # the reward is what it then paid (evaluate.py counts these attempts).
    tampered: list = dataclasses.field(default_factory=list)


def handed_off(ep):
    """The hand-offs after which the episode went on (a failed last one ended it)."""
    return [h for h in ep.handoffs if h.fallback is not None]


def segments(ep):
    """[(start, end)] of each context the policy sampled replies in, in token_ids: the first, then the one after
    each hand-off. Each is a sequence the policy saw from its first token: its actions' log-probs are of it alone."""
    starts = [0] + [h.start for h in handed_off(ep)]
    return list(zip(starts, starts[1:] + [len(ep.token_ids)]))


def contexts(ep):
    """The messages of each context of segments(): the first, up to the first hand-off; each hand-off's context and
    the messages after it up to the next. A context that was handed off ends with the observation that did not fit
    (its tokens cut at the context length)."""
    done = handed_off(ep)
    ats = [h.at for h in done] + [len(ep.messages)]
    return [ep.messages[:ats[0]]] + [h.context + ep.messages[h.at:end] for h, end in zip(done, ats[1:])]
