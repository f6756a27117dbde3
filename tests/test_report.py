"""jaxrlhf.report: metric values checked by hand, report files, and the training-run plot."""

import json
import math

import numpy as np
import pytest
from matplotlib.image import imread

from jaxrlhf.report import (
    build_report,
    moving_average,
    pass_at_1,
    perplexity,
    plot_training,
    win_rate,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_policy_copying_reference_wins_half():
    scores = [0.3, -1.2, 2.5, 0.0]
    assert win_rate(scores, list(scores)) == (0.5, 0.0)


def test_win_rate_three_wins_one_tie():
    # Outcomes 1, 1, 1, 0.5: mean 0.875; deviations 0.125 x3 and -0.375, squares sum to 0.1875,
    # sample variance 0.1875 / 3 = 0.0625, s = 0.25, stderr = 0.25 / sqrt(4) = 0.125.
    rate, stderr = win_rate([2.0, 3.0, 1.0, 5.0], [1.0, 2.5, 0.0, 5.0])
    assert rate == pytest.approx(0.875)
    assert stderr == pytest.approx(0.125)


def test_win_rate_tie_tolerance_and_losses():
    assert win_rate([1.0, 2.0], [1.05, 1.0])[0] == pytest.approx(0.5)  # loss, win
    assert win_rate([1.0, 2.0], [1.05, 1.0], tie_tolerance=0.1)[0] == pytest.approx(0.75)
    assert win_rate([0.0, 0.0], [1.0, 1.0])[0] == 0.0


def test_win_rate_rejects_bad_input():
    with pytest.raises(ValueError, match="policy_scores=2, reference_scores=3"):
        win_rate([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="empty"):
        win_rate([], [])
    with pytest.raises(ValueError, match="finite"):
        win_rate([float("nan")], [0.0])
    assert math.isnan(win_rate([1.0], [0.0])[1])  # one prompt: stderr undefined


def test_perplexity_of_coin_flips_is_two():
    ppl, nll = perplexity([np.full(5, math.log(0.5)), np.full(2, math.log(0.5))])
    assert ppl == pytest.approx(2.0)
    assert nll == pytest.approx(math.log(2))


def test_perplexity_weights_tokens_not_responses():
    # 1 token at p=1/2 and 3 tokens at p=1/4: NLL = (ln2 + 3 * 2ln2) / 4 = 7/4 ln2, ppl = 2^(7/4).
    # Averaging per response instead would give 2^(3/2).
    ppl, nll = perplexity([np.log([0.5]), np.log([0.25, 0.25, 0.25])])
    assert nll == pytest.approx(1.75 * math.log(2))
    assert ppl == pytest.approx(2**1.75)


def test_perplexity_needs_tokens():
    with pytest.raises(ValueError, match="at least one response"):
        perplexity([])
    with pytest.raises(ValueError, match="no tokens"):
        perplexity([np.array([]), np.array([])])
    with pytest.raises(ValueError, match="expected 1-D"):
        perplexity([np.zeros((2, 3))])


def test_pass_at_1():
    assert pass_at_1([True, False, True, True]) == 0.75
    assert pass_at_1([1.0, 0.5, 0.0]) == pytest.approx(0.5)  # fractions of k samples correct
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pass_at_1([2.0])
    with pytest.raises(ValueError, match="at least one"):
        pass_at_1([])


def test_build_report_keys_and_values():
    report = build_report(
        response_lengths=[3, 5, 4, 8],
        policy_scores=[2.0, 3.0, 1.0, 5.0],
        reference_scores=[1.0, 2.5, 0.0, 5.0],
        sft_logprobs=[np.log([0.5] * n) for n in (3, 5, 4, 8)],
        correct=[True, True, False, True],
        extra={"checkpoint": "runs/x/step_100", "seed": np.int64(7)},
    )
    assert report == {
        "num_prompts": 4,
        "response_length_mean": 5.0,
        "response_length_max": 8,
        "win_rate": 0.875,
        "win_rate_stderr": pytest.approx(0.125),
        "gold_reward_policy_mean": 2.75,
        "gold_reward_reference_mean": 2.125,
        "ties": 1,
        "sft_perplexity": pytest.approx(2.0),
        "sft_nll_per_token": pytest.approx(math.log(2)),
        "pass_at_1": 0.75,
        "checkpoint": "runs/x/step_100",
        "seed": 7,
    }
    assert all(type(v) in (int, float, str) for v in report.values())
    json.dumps(report)


def test_build_report_lengths_only():
    assert build_report(response_lengths=[2, 4]) == {
        "num_prompts": 2,
        "response_length_mean": 3.0,
        "response_length_max": 4,
    }


def test_build_report_names_mismatched_inputs():
    with pytest.raises(ValueError, match="response_lengths=3, policy_scores=3, reference_scores=2"):
        build_report(response_lengths=[1, 2, 3], policy_scores=[1, 2, 3], reference_scores=[1, 2])
    with pytest.raises(ValueError, match="correct=1"):
        build_report(response_lengths=[1, 2], correct=[True])
    with pytest.raises(ValueError, match="both policy_scores and reference_scores"):
        build_report(response_lengths=[1], policy_scores=[1.0])
    with pytest.raises(ValueError, match="clashes"):
        build_report(response_lengths=[1], extra={"num_prompts": 3})


def _samples():
    return [
        {
            "prompt": f"p{i}",
            "response": "r",
            "policy_score": p,
            "reference_score": r,
            "response_length": n,
        }  # fmt: skip
        for i, (p, r, n) in enumerate([(2.0, 1.0, 3), (3.0, 2.5, 5), (1.0, 0.0, 4), (5.0, 5.0, 8)])
    ]


def test_write_report_files(tmp_path):
    samples = _samples()
    report = build_report(
        response_lengths=[s["response_length"] for s in samples],
        policy_scores=[s["policy_score"] for s in samples],
        reference_scores=[s["reference_score"] for s in samples],
    )
    paths = write_report(report, samples, tmp_path / "eval")
    assert set(paths) == {"report", "samples", "plot"}
    assert json.loads(paths["report"].read_text()) == report
    assert paths["report"].read_text().startswith('{\n  "num_prompts"')  # indent 2
    lines = paths["samples"].read_text().splitlines()
    assert [json.loads(line) for line in lines] == samples
    png = paths["plot"].read_bytes()
    assert png.startswith(PNG_MAGIC)
    height, width, _ = imread(paths["plot"]).shape
    assert (height, width) == (400, 1350)  # three panels side by side at 100 dpi


def test_write_report_without_plottable_samples(tmp_path):
    samples = [{"prompt": "p", "response": "r", "score": np.float32(0.5)}]
    paths = write_report({"num_prompts": 1}, samples, tmp_path)
    assert json.loads(paths["samples"].read_text()) == {
        "prompt": "p",
        "response": "r",
        "score": 0.5,
    }
    assert paths["plot"].read_bytes().startswith(PNG_MAGIC)


def _write_metrics(path, steps, eval_every=None):
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "reward_mean": step / steps, "kl": 0.01 * step, "step_s": 6.0}
            if eval_every and step % eval_every == 0:
                record["eval_accuracy"] = 0.1 * step / eval_every
            f.write(json.dumps(record) + "\n")
    return path


@pytest.mark.parametrize("eval_every", [None, 5])
def test_plot_training(tmp_path, eval_every):
    metrics = _write_metrics(tmp_path / "metrics.jsonl", 20, eval_every)
    out = plot_training(metrics, tmp_path / "plots" / "training.png", eval_points=[(0, 0.05)])
    assert out.read_bytes().startswith(PNG_MAGIC)
    height, width, _ = imread(out).shape
    assert (width, height) == (800, 920)  # reward, eval and kl panels stacked


def test_plot_training_skips_missing_panels_and_plots_time(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward_mean": 0.5, "step_s": 30}) + "\n"
                            for s in (1, 2, 3)))  # fmt: skip
    out = plot_training(path, tmp_path / "t.png", x="time")
    assert imread(out).shape[:2] == (360, 800)  # reward panel only


def test_plot_training_errors(tmp_path):
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        plot_training(empty, tmp_path / "x.png")
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"step": 1, "loss": 2.0, "step_seconds": 1.0}) + "\n")
    with pytest.raises(ValueError, match="none of reward_mean"):
        plot_training(sft, tmp_path / "x.png")
    metrics = _write_metrics(tmp_path / "m.jsonl", 4)
    with pytest.raises(ValueError, match="step 9"):
        plot_training(metrics, tmp_path / "x.png", eval_points=[(9, 0.5)])
    with pytest.raises(ValueError, match="'step' or 'time'"):
        plot_training(metrics, tmp_path / "x.png", x="epoch")


def test_moving_average_is_trailing_and_starts_at_first_point():
    np.testing.assert_allclose(moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1, 2, 4, 6])
