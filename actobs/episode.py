"""
An episode's record, as envs.run_episodes fills it and grpo.py, evaluate.py and the step log read it: the
conversation, the reward and how it ended (the failure kinds), the token sequence a token-level policy saw and
produced, and the tamper evidence. docs/sandboxes.md#how-episodes-end.
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
class Episode:
    task: str
    messages: list  # Nemotron form: user (prompt), then assistant / user (observation) turns
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
    # Filled by token-level policies (engine.VLLMPolicy): the one append-only sequence the policy saw and
    # produced, one label per token (labels.PROMPT / ACTION / OBS), the behaviour log-prob of each token
    # (0.0 where not sampled), which OBS tokens are the protocol's fixed wrapper text, and whether the context
    # length cut the episode (then its messages end with the last observation).
    token_ids: list = dataclasses.field(default_factory=list)
    roles: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    obs_wrapper: list = dataclasses.field(default_factory=list)
    truncated: bool = False
    # Under a grammar (engine.VLLMPolicy): the distinct masks the replies were sampled under (packed bits) and, per
    # token, its mask's index in them, -1 where nothing was masked.
    masks: list = dataclasses.field(default_factory=list)
    mask_ids: list = dataclasses.field(default_factory=list)
    # Replies that reached the policy's max_new_tokens (under a grammar the engine closed each: grammar.close_reply)
    cut_replies: int = 0
    # Tamper evidence: the verifier-loaded files the agent wrote (verify.prepare_verifier: anything in /tests, a
    # conftest.py or pytest ini in /, Python start-up hooks, pytest plugin registrations, the stand-in's uv and
    # wheels) and the verifier's programs it changed (verify.program_changes). Under strict verification the episode
    # then ends as `tampered`, reward 0; otherwise the verifier ran without the planted inputs where it could, and
    # the reward is what it then paid (evaluate.py counts these attempts).
    tampered: list = dataclasses.field(default_factory=list)
