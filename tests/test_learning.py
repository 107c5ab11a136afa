"""GRPO learns through the whole RL path: multi-turn episodes in real sandboxes, vLLM rollouts, the trainer's
update and the weight sync, all through `grpo.main` as a user runs it.

The world: two tasks ask for a secret word, one of four named in the instruction, written to /app/answer.txt;
the verifier pays only for `cedar`. The policy is SFT'd (sft.main) on scripted episodes that write each of the
four words equally often, so it solves about a quarter of its episodes and only the reward can tell it which
word is right. GRPO must raise the solve rate from the first steps to the last; the same run with the
advantage's sign flipped must not. The rollout/trainer log-prob mismatch stays ≤ 0.01 at every step."""
import json
import random

import pytest

from conftest import ScriptedAsync
import envs
import grpo
import sft
from actobs import passk, tiny
from actobs.sandbox import daemon
from actobs.tasks import load_tasks

pytestmark = [pytest.mark.docker, pytest.mark.vllm, pytest.mark.slow]

WORDS = ("amber", "basil", "cedar", "delta")
RIGHT = "cedar"
INSTRUCTIONS = ("Write the secret word ({}) into /app/answer.txt.",
                "Put the secret word ({}) in the file /app/answer.txt.")
PROMPT = ('Reply with one JSON object: {"analysis": "", "plan": "", '
          '"commands": [{"keystrokes": "ls\\n", "duration": 0.1}], '
          '"task_complete": false}.\n\nTask:\n{instruction}\n\nCurrent terminal state:\n{terminal_state}\n')
# GRPO: 2 tasks x 8 episodes a step, lr 1e-3 with the k3 KL to the SFT policy at 0.1. Without the KL term this
# tiny policy (hidden 64, 2 layers) lost its reply format within a few steps (KL from init 0.3-1.7 nats/token by
# step 3 at lr 1e-3 and 2e-3: a failed episode's confirm turn is pushed down along with its wrong word, and the push
# spreads to every context), and at lr 5e-4 it barely moved in ten steps. With it, measured: 0.17 -> 0.81 (mean of
# the first / last three of 16 steps), and 0.06 -> 0.0 with the sign flipped; a second run of the same 16 steps
# was slower (0.06 -> 0.31 at step 11), so the test gives it 24. Over 24 steps the rate rises to ~0.6 by step 10
# and stays there, held down by replies that lose their format as the policy moves (parse errors and turn limits in
# 3-12 of a step's 16 episodes): three runs' last 8 steps solved 0.60, 0.66 and 0.74 (the first 3: 0.25 each), and
# one CI run ended at 0.58 over its last 3, under the 0.6 an earlier form of this test asked. So the test asks for
# a rise that chance does not explain: the last 8 steps' solve rate above the first 3 steps' by a one-sided
# two-proportion z of 3 or more (p ≈ 0.001; the three runs had 4.2, 4.8 and 6.0).
STEPS, LR, KL, TWIN_STEPS = 24, "1e-3", "0.1", 8
TASKS_PER_STEP, GROUP = 2, 8


def reply(keys, done):
    return json.dumps({"analysis": "", "plan": "", "commands": [{"keystrokes": k, "duration": 0.1} for k in keys],
                       "task_complete": done})


def turns(word):
    """The scripted episode that writes `word`: look, write it, confirm."""
    return [reply(["ls\n"], False), reply([f"echo {word} > answer.txt\n"], True), reply([], True)]


@pytest.fixture(scope="module")
def world(tmp_path_factory, base_image):
    root = tmp_path_factory.mktemp("learning")
    (root / "prompt.txt").write_text(PROMPT)
    for i, text in enumerate(INSTRUCTIONS):
        d = root / "tasks" / f"secret-{i}"
        (d / "tests").mkdir(parents=True)
        (d / "environment").mkdir()
        (d / "instruction.md").write_text(text.format(", ".join(WORDS)) + "\n")
        (d / "tests" / "test.sh").write_text(f'[ "$(cat /app/answer.txt 2>/dev/null)" = {RIGHT} ] && r=1 || r=0\n'
                                             "echo $r > /logs/verifier/reward.txt\n")
        (d / "environment" / "Dockerfile").write_text(f"FROM {daemon.BASE_IMAGE}\nWORKDIR /app\n")
        (d / "task.toml").write_text("[verifier]\ntimeout_sec = 30\n\n[agent]\ntimeout_sec = 120\n\n"
                                     "[environment]\nmemory_mb = 256\n")
    tasks = load_tasks(root / "tasks")
    todo = [(t, w) for t in tasks for w in WORDS]
    script = ScriptedAsync({k: turns(w) for k, (_, w) in enumerate(todo)})
    eps = envs.run_episodes([t for t, _ in todo], script, max_turns=4, concurrency=8, template=PROMPT)
    assert [e.reward for e in eps] == [float(w == RIGHT) for _, w in todo], [(e.failure, e.error) for e in eps]
    rows = [{"conversations": e.messages} for e in eps] * 16  # each word equally often: the SFT'd policy guesses
    random.Random(0).shuffle(rows)
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = tiny.build_tiny(root / "base", [m["content"] for e in eps for m in e.messages] * 4, vocab_size=1024,
                          hidden=64, layers=2, heads=2, kv_heads=1)  # head size 32: vLLM's CPU attention takes it
    sft.main(["--model", base, "--data", str(root / "sft.jsonl"), "--out", str(root / "sft"), "--lam", "0",
              "--lr", "1e-2",
              "--batch-size", "8", "--epochs", "12", "--max-len", "1024", "--val-size", "8", "--eval-every", "0",
              "--save-every", "0", "--warmup-ratio", "0.05"])
    return root


def run_grpo(world, out, steps):
    grpo.main(["--init", str(world / "sft" / "final"), "--tasks", str(world / "tasks"), "--out", str(out),
               "--prompt-template", str(world / "prompt.txt"), "--steps", str(steps),
               "--tasks-per-step", str(TASKS_PER_STEP), "--group-size", str(GROUP), "--lr", LR, "--kl-coef", KL,
               "--max-turns", "4", "--max-parse-errors", "3", "--max-new-tokens", "48", "--max-len", "1024",
               "--concurrency", "16", "--save-every", str(steps)])
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def mean(xs):
    return sum(xs) / len(xs)


def test_grpo_raises_the_solve_rate(world, tmp_path, no_leftovers):
    rows = run_grpo(world, tmp_path / "run", STEPS)
    curve = [r["rollout/solve_rate"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert mean(curve[:3]) <= 0.4, curve  # the SFT'd policy guesses
    early, late = passk.solved_counts(rows[:3]), passk.solved_counts(rows[-8:])
    assert passk.rise_z(early, late) >= 3, curve  # GRPO found the word
    mismatch = [r.get("train/mismatch_abs", 0.0) for r in rows]  # absent on a step that trained nothing
    assert max(mismatch) <= 0.01, mismatch


def test_flipped_advantage_does_not_learn(world, tmp_path, monkeypatch, no_leftovers):
    """The same run with every advantage negated: the policy moves away from the paid word."""
    real = grpo.group_advantages
    monkeypatch.setattr(grpo, "group_advantages", lambda *a, **k: (lambda adv, sig: (-adv, sig))(*real(*a, **k)))
    rows = run_grpo(world, tmp_path / "run", TWIN_STEPS)
    curve = [r["rollout/solve_rate"] for r in rows]
    assert mean(curve[-3:]) <= min(0.3, mean(curve[:3]) + 0.1), curve
    assert max(r.get("train/mismatch_abs", 0.0) for r in rows) <= 0.01
