"""scripts/act_eval.py: the unbiased pass@k estimator and the per-group table."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import act_eval  # noqa: E402
import envs  # noqa: E402
import terminus  # noqa: E402


@pytest.mark.parametrize("n,c,k", [(16, 0, 1), (16, 1, 1), (16, 3, 4), (16, 5, 16), (16, 16, 16), (10, 2, 8), (10, 9, 2)])
def test_pass_at_k_is_the_combinatorial_estimator(n, c, k):
    assert act_eval.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_summary_counts_solved_parse_errors_and_ends():
    bad = {"role": "user", "content": terminus.parse_error_message("No valid JSON found in response", [])}
    obs = {"role": "user", "content": terminus.OUTPUT_HEADER + "root@h:/app# ls\n"}
    reply = {"role": "assistant", "content": "{}"}
    eps = [envs.Episode("rename-1", [obs, reply, obs, reply], reward=1.0, turns=2),
           envs.Episode("rename-1", [obs, reply, bad, reply], reward=0.0, turns=2),  # completed, verifier says 0
           envs.Episode("archive-2", [obs, reply, bad, reply, bad, reply], turns=3, failure="parse_errors"),
           envs.Episode("archive-2", [obs, reply], turns=1, failure="max_turns")]
    row = act_eval.summarise(eps, [1, 2, 16], 2)
    assert row["tasks"] == 2 and row["episodes"] == 4
    assert row["pass@1"] == pytest.approx((0.5 + 0.0) / 2) and row["pass@2"] == pytest.approx(0.5)
    assert "pass@16" not in row  # k > n is not estimable
    assert row["mean_turns"] == pytest.approx(8 / 4)
    assert row["parse_error_rate"] == pytest.approx(4 / 8)  # 3 answered with an error message + the last one
    assert row["ends"] == {"solved": 1, "wrong": 1, "parse_errors": 1, "max_turns": 1}
    assert act_eval.kind_of("actobs/replace_host-0123456789") == "replace_host"
