"""The claims' analysis (jaxrlhf.experiments.claims) on hand-written run records: paired
comparisons, Holm's correction and verdicts computed by hand; and the plans' arms."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from jaxrlhf.experiments.claims.analysis import arm_rows, by_arm, run_figures
from jaxrlhf.experiments.claims.claim_registry import CLAIMS, claim
from jaxrlhf.experiments.claims.figures import claims_table, markdown
from jaxrlhf.experiments.claims.losses_robust import loss_cells
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.verdicts import analyse


def write_run(folder: Path, test: float, validation: float = 0.5, kl: float = 0.1,
              steps: int = 4, mixed: float = 0.0, start: float = 0.2) -> None:  # fmt: skip
    """A finished run's records: `steps` steps, an evaluation at step 2, accuracies in [0, 1]."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"step": s, "step_s": 0.5, "kl": kl * s / steps, "staleness_mean": min(s - 1, 1),
                "token_staleness_max": min(s - 1, 1),
                "mixed_version_fraction": mixed, "learner_idle_fraction": 0.1,
                **({"test_accuracy": test / 2, "eval_accuracy": validation / 2} if s == 2 else {})}
               for s in range(1, steps + 1)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"test_accuracy_start": start, "eval_accuracy_start": start,
               "test_accuracy_end": test, "eval_accuracy_end": validation,
               "wall_seconds": 9.0}  # fmt: skip
    (folder / "summary.json").write_text(json.dumps(summary))


def test_async_as_good_pairs_by_seed_and_judges_by_the_interval(tmp_path):
    settings = Settings(seeds=(0, 1, 2), steps=4, eval_every=2)
    runs = claim("a").plan(settings, tmp_path)
    # sync 50, 60, 70 %; one-step-off 1, 2, 3 points higher; continuous 10, 11, 12 lower.
    for run in runs:
        sync = 0.5 + 0.1 * run.labels["seed"]
        offset = {"sync": 0.0, "one-step-off": 0.01 * (run.labels["seed"] + 1),
                  "continuous": -0.10 - 0.01 * run.labels["seed"]}[run.labels["arm"]]  # fmt: skip
        write_run(run.folder, sync + offset)
    record = analyse("a", runs, settings)
    by_name = {c["name"]: c for c in record["comparisons"]}
    # one-step-off − sync: 1, 2, 3 points: mean 2, s.e. 1/sqrt(3), 95% CI 2 ± 2.484, p 0.074.
    osf = by_name["one-step-off − sync"]
    assert osf["mean"] == pytest.approx(2.0) and osf["low"] == pytest.approx(-0.484, abs=1e-3)
    assert osf["p"] == pytest.approx(0.0742, abs=1e-4) and not osf["beyond_noise"]
    # continuous − sync: −10, −11, −12: CI −11 ± 2.484, p = 0.0027 (t = 19.05, 2 d.f.); Holm
    # over 2: 0.0027 <= 0.025 rejects, and 0.074 > 0.05 does not.
    cont = by_name["continuous − sync"]
    assert cont["mean"] == pytest.approx(-11.0) and cont["beyond_noise"]
    assert record["family_size"] == 2
    assert record["verdict"]["word"] == "contradicted"
    rows = {r["arm"]: r for r in record["rows"]}
    assert rows["sync"]["test"] == pytest.approx(60.0) and rows["sync"]["seeds"] == 3
    # The records: staleness 0 at update 1, then 1; the oldest token 1 version behind.
    assert (
        rows["sync"]["staleness_later"] == [1.0, 1.0] and rows["sync"]["token_staleness_max"] == 1
    )
    assert "| 1.00-1.00 | 1 |" in markdown(record)


def test_an_accuracy_of_zero_is_a_figure_and_a_missing_one_is_nan(tmp_path):
    settings = Settings(seeds=(0, 1), steps=4, eval_every=2)
    runs = [r for r in claim("a").plan(settings, tmp_path) if r.labels["arm"] == "sync"]
    for run in runs:  # a model that answers nothing right, before and after training
        write_run(run.folder, 0.0, validation=0.0, start=0.0)
    summary = json.loads((runs[1].folder / "summary.json").read_text())
    summary |= {"eval_accuracy_start": None, "eval_accuracy_end": None}
    del summary["test_accuracy_start"]
    (runs[1].folder / "summary.json").write_text(json.dumps(summary))
    zero, missing = run_figures(runs[0]), run_figures(runs[1])
    assert [zero[k] for k in ("test", "validation", "test_start", "validation_start")] == [0.0] * 4
    assert missing["test"] == 0.0
    assert all(math.isnan(missing[k]) for k in ("validation", "test_start", "validation_start"))
    row = arm_rows(by_arm(runs), {"sync": 2})[0]
    assert row["test_start"] == 0.0 and row["test"] == 0.0


def test_async_as_good_is_supported_only_above_the_margin(tmp_path):
    settings = Settings(seeds=tuple(range(6)), steps=4, eval_every=2)
    runs = claim("a").plan(settings, tmp_path)
    # every async arm within ±0.5 point of sync: both intervals lie above −2 points.
    for run in runs:
        noise = 0.005 * (-1) ** run.labels["seed"] if run.labels["arm"] != "sync" else 0.0
        write_run(run.folder, 0.5 + 0.01 * run.labels["seed"] + noise)
    record = analyse("a", runs, settings)
    assert record["verdict"]["word"] == "supported"
    assert all(c["low"] > -2 for c in record["comparisons"])


def test_a_deficit_beyond_noise_inside_the_margin_is_as_good_and_named(tmp_path):
    settings = Settings(seeds=tuple(range(6)), steps=4, eval_every=2)
    runs = claim("a").plan(settings, tmp_path)
    # continuous 1.0 or 1.2 points below sync, alternately: mean −1.1, s.d. 0.1095, s.e.
    # 0.0447, 95% CI −1.1 ± 2.571 · 0.0447 = [−1.215, −0.985]: beyond noise (p < 1e-5, Holm
    # over 2 rejects it), wholly below 0, but above −2. One-step-off equals sync.
    for run in runs:
        seed, arm = run.labels["seed"], run.labels["arm"]
        below = (0.010 + 0.002 * (seed % 2)) if arm == "continuous" else 0.0
        write_run(run.folder, 0.5 + 0.01 * seed - below)
    record = analyse("a", runs, settings)
    cont = {c["name"]: c for c in record["comparisons"]}["continuous − sync"]
    assert cont["mean"] == pytest.approx(-1.1) and cont["beyond_noise"]
    assert cont["low"] == pytest.approx(-1.215, abs=1e-3) and cont["high"] < 0
    assert record["verdict"]["word"] == "supported"
    assert "continuous − sync: lower beyond noise, inside the 2-point margin" in (
        record["verdict"]["detail"])  # fmt: skip


def test_a_pilot_gives_the_spread_and_the_seeds_it_needs(tmp_path):
    settings = Settings(seeds=(0, 1, 2, 3), steps=4, eval_every=2)
    runs = claim("pilot").plan(settings, tmp_path)
    # differences 0, 10, 0, 10 points: s.d. 5.774; t(0.975, n−1)·5.774/sqrt(n) <= 2 first at
    # n = 35 (2.032 · 5.774 / 5.916 = 1.983; at 34, 2.035 · 5.774 / 5.831 = 2.015).
    for run in runs:
        diff = 0.1 * (run.labels["seed"] % 2) if run.labels["arm"] == "one-step-off" else 0.0
        write_run(run.folder, 0.5 + diff)
    power = analyse("pilot", runs, settings)["power"]
    assert power["spread"] == pytest.approx(5.7735, abs=1e-3) and power["seeds_needed"] == 35


def test_the_loss_claim_compares_falls_from_on_policy(tmp_path):
    settings = Settings(seeds=(0, 1, 2), steps=4, eval_every=2, losses=("online_dpo", "rloo"),
                        mini_batches=(1, 4), corrections=("none",))  # fmt: skip
    runs = claim("b").plan(settings, tmp_path)
    assert sorted({r.labels["arm"] for r in runs}) == ["online_dpo/N1", "online_dpo/N4",
                                                       "rloo/N1", "rloo/N4"]  # fmt: skip
    # Online DPO falls 2 points (60 -> 58); RLOO falls 10, 11, 12 (60 -> 50, 49, 48): RLOO's
    # fall − DPO's = 8, 9, 10.
    for run in runs:
        fall = {"online_dpo": 0.02, "rloo": 0.10 + 0.01 * run.labels["seed"]}[run.labels["variant"]]
        write_run(run.folder, 0.6 - (fall if run.labels["num_mini_batches"] == 4 else 0.0))
    record = analyse("b", runs, settings)
    (only,) = record["comparisons"]
    assert only["name"] == "rloo − online_dpo, fall at N=4" and only["mean"] == pytest.approx(9.0)
    assert only["beyond_noise"] and record["verdict"]["word"] == "supported"
    # With a fourth seed planned and not run, the same comparison stands, with no verdict yet.
    more = dataclasses.replace(settings, seeds=(0, 1, 2, 3))
    part = analyse("b", claim("b").plan(more, tmp_path), more)
    assert part["comparisons"] == record["comparisons"]
    assert part["verdict"]["word"] == "part-run"
    assert part["verdict"]["detail"] == "12 of 16 runs finished; the verdict waits for all of them"
    row = claims_table([(claim("b"), part)]).splitlines()[-1]
    assert row.endswith("| part-run (12 of 16 runs finished) |")


def test_a_seed_is_paired_only_within_one_start_model(tmp_path):
    """A seed whose arms started from different builds of one model (two machines) is left out
    of the comparisons it would mix; a seed run wholly on another machine stays paired, and the
    sizes of claim (c) differ by design."""
    settings = Settings(seeds=(0, 1, 2, 3), steps=4, eval_every=2, losses=("online_dpo", "rloo"),
                        mini_batches=(1, 4), corrections=("none",))  # fmt: skip
    runs = claim("b").plan(settings, tmp_path / "b")
    for run in runs:  # RLOO falls 10 + seed points, Online DPO 2: fall difference 8 + seed
        seed, arm = run.labels["seed"], run.labels["arm"]
        fall = {"online_dpo": 0.02, "rloo": 0.10 + 0.01 * seed}[run.labels["variant"]]
        # Seed 2 ran wholly on another machine; of seed 3, rloo/N4 alone did (5 points higher).
        alone = (seed, arm) == (3, "rloo/N4")
        start, shift = (0.21 if seed == 2 or alone else 0.2), (0.05 if alone else 0.0)
        write_run(run.folder, 0.6 + shift - (fall if run.labels["num_mini_batches"] == 4 else 0.0),
                  start=start)  # fmt: skip
    record = analyse("b", runs, settings)
    (only,) = record["comparisons"]
    assert only["seeds"] == 3 and only["mean"] == pytest.approx(9.0)  # seeds 0, 1, 2
    assert sorted((m["test_start"], m["runs"]) for m in record["starts"]) == [(20.0, 11), (21.0, 5)]
    assert (
        "Start models (test % / validation % before training): bed 20.0 / 20.0 (11 runs)"
        in markdown(record)
    )
    sizes = Settings(seeds=(0, 1), steps=4, eval_every=2, sizes=("bed", "bed-m"),
                     size_mini_batches=(1, 16))  # fmt: skip
    c_runs = claim("c").plan(sizes, tmp_path / "c")
    for run in c_runs:  # the larger starts higher and falls 1 point less
        large = run.labels["size"] == "bed-m"
        fall = (0.04 - 0.01 * large) if run.labels["num_mini_batches"] == 16 else 0.0
        write_run(run.folder, 0.6 + 0.001 * run.labels["seed"] - fall, start=0.3 if large else 0.2)
    (c,) = analyse("c", c_runs, sizes)["comparisons"]
    assert c["seeds"] == 2 and c["mean"] == pytest.approx(1.0)


def test_k4_against_k2_counts_updates_and_learner_seconds_to_the_target(tmp_path):
    settings = Settings(seeds=(0, 1, 2), steps=4, eval_every=2)
    runs = claim("d").plan(settings, tmp_path)
    # Both arms end at 50% validation: the target is 50% test. K2 ends at 60% test (30% at
    # step 2): it reaches the target at step 4, after 4 x 0.5 s. K4 ends at 100% (50% at step
    # 2: reached there, after 1 s) for seeds 0 and 1, and at 90% (45% at step 2) for seed 2.
    for run in runs:
        k4 = run.labels["samples_per_prompt"] == 4
        write_run(run.folder, (0.9 if run.labels["seed"] == 2 else 1.0) if k4 else 0.6)
    record = analyse("d", runs, settings)
    updates, seconds, kl = record["comparisons"]
    assert updates["name"] == "updates to 50.0% test: K4 − K2"
    assert updates["mean"] == pytest.approx((-2 - 2 + 0) / 3)
    assert seconds["name"] == "learner seconds to the target: K4 − K2"
    assert seconds["mean"] == pytest.approx((-1 - 1 + 0) / 3)
    # KL is 0.1 x step / 4: 0.05 at step 2, 0.1 at step 4.
    assert kl["mean"] == pytest.approx((-0.05 - 0.05 + 0) / 3)
    assert record["verdict"]["word"] == "unresolved at this power"  # 3 seeds, one at 0


def test_loss_cells_put_corrections_at_their_n_only():
    settings = Settings(seeds=(0,), losses=("online_dpo", "grpo"), mini_batches=(1, 16),
                        corrections=("none", "mask"), correction_mini_batches=(16,))  # fmt: skip
    assert loss_cells(settings) == [("online_dpo", 1), ("online_dpo", 16), ("grpo", 1),
                                    ("grpo", 16), ("grpo+none", 16), ("grpo+mask", 16)]  # fmt: skip
    # The control re-anchors π_old on the learner and corrects nothing; plain GRPO keeps the
    # sampler's log-probs.
    runs = {r.labels["arm"]: r for r in claim("b").plan(settings, Path("/x"))}
    control = runs["grpo+none/N16"].overrides
    assert control["loss_params.old_logprobs"] == "learner"
    assert control["loss_params.is_correction"] == "none"
    assert "loss_params.old_logprobs" not in runs["grpo/N16"].overrides


def test_corrections_on_mixed_samples_are_measured_against_the_reanchored_control(tmp_path):
    settings = Settings(seeds=(0, 1, 2), steps=4, eval_every=2, corrections=("none", "mask"))
    runs = claim("f").plan(settings, tmp_path)
    assert [r.labels["arm"] for r in runs[:4]] == ["online_dpo", "grpo", "grpo+none", "grpo+mask"]
    # GRPO 50%; the control 2, 3, 4 points above it; mask −1, 0, +1 around the control;
    # Online DPO 10, 11, 12 below GRPO. Every run mixes versions in 40% of its samples.
    for run in runs:
        seed = run.labels["seed"]
        control = 0.50 + 0.01 * (seed + 2)
        test = {"grpo": 0.50, "grpo+none": control, "grpo+mask": control + 0.01 * (seed - 1),
                "online_dpo": 0.40 - 0.01 * seed}[run.labels["arm"]]  # fmt: skip
        write_run(run.folder, test, mixed=0.4)
    record = analyse("f", runs, settings)
    by_name = {c["name"]: c for c in record["comparisons"]}
    assert sorted(by_name) == ["grpo+mask − grpo+none", "grpo+none − grpo", "online_dpo − grpo"]
    # control − GRPO: 2, 3, 4: mean 3, t = 3 / (1 / sqrt 3) = 5.196 on 2 d.f., p = 0.0351; Online
    # DPO: −10, −11, −12, p = 0.0027. Holm over 3: 0.0027 <= 0.05/3 rejects; 0.0351 > 0.05/2
    # stops there.
    assert by_name["grpo+none − grpo"]["mean"] == pytest.approx(3.0)
    assert by_name["grpo+none − grpo"]["p"] == pytest.approx(0.0351, abs=1e-4)
    assert not by_name["grpo+none − grpo"]["beyond_noise"]
    assert by_name["grpo+mask − grpo+none"]["mean"] == pytest.approx(0.0, abs=1e-9)
    assert by_name["online_dpo − grpo"]["beyond_noise"]
    assert record["verdict"]["word"] == "differences beyond noise: online_dpo − grpo"
    # Without the control's runs (records before it existed), mask is against plain GRPO.
    for run in runs:
        if run.labels["arm"] == "grpo+none":
            (run.folder / "summary.json").unlink()
    names = {c["name"] for c in analyse("f", runs, settings)["comparisons"]}
    assert names == {"grpo+mask − grpo", "online_dpo − grpo"}


def test_every_claim_plans_bed_runs_with_a_test_evaluation_at_the_end(tmp_path):
    settings = Settings(seeds=(3,), steps=64, eval_every=16)
    for spec in CLAIMS:
        runs = spec.plan(settings, tmp_path)
        assert runs and all(r.overrides["seed"] == 3 for r in runs), spec.name
        # the tunings and (d)'s pilot choose on validation: the test split stays off
        tuning = spec.name in ("b-tuning", "lora-tuning", "lora-smollm2-tuning", "d-pilot")
        assert spec.config == ("default.py" if "smollm2" in spec.name else "bed.py"), spec.name
        assert all(r.overrides["eval.test"] != tuning and r.overrides["eval.at_end"]
                   for r in runs)  # fmt: skip
        # (the pilot's runs are (a)'s sync and one-step-off runs: they count there too)
        home = "a" if spec.name == "pilot" else spec.name
        assert {r.folder.relative_to(tmp_path).parts[0] for r in runs} == {home}


def test_the_committed_start_models_are_the_recipes_builds():
    """One committed build per size, named as the cache names the recipe's build (a recipe
    change leaves it unused, visibly), its bed.json naming the same digest."""
    from jaxrlhf.experiments.claims.start_models import COMMITTED, FILES
    from jaxrlhf.models import bed

    names = sorted(p.name for p in COMMITTED.iterdir())
    assert names == sorted(
        f"{s}-{bed.Recipe(size=s).digest()[:16]}" for s in ("bed", "bed-m", "bed-l")
    )
    for name in names:
        assert all((COMMITTED / name / f).stat().st_size > 0 for f in FILES)
        recorded = json.loads((COMMITTED / name / "bed.json").read_text())
        assert name.endswith(recorded["digest"][:16])


def test_installing_start_models_replaces_another_build_of_the_recipe(tmp_path):
    from jaxrlhf.experiments.claims.start_models import FILES, install
    from jaxrlhf.models.built import COMPLETE

    committed, cache = tmp_path / "committed", tmp_path / "cache"
    for name in ("bed-1111", "bed-m-2222"):
        (committed / name).mkdir(parents=True)
        for f in FILES:
            (committed / name / f).write_text(f"{name}/{f}")
    other = cache / "bed-1111"  # this machine's build of the same recipe: other weights
    other.mkdir(parents=True)
    for f in FILES:
        (other / f).write_text("built here" if f == "model.safetensors" else f"bed-1111/{f}")
    (other / COMPLETE).write_text("")
    lines = install(committed, cache)
    assert [line.split(":")[0] for line in lines] == ["bed-1111", "bed-m-2222"]
    assert "replaced" in lines[0] and "copied" in lines[1]
    for name in ("bed-1111", "bed-m-2222"):
        assert (cache / name / COMPLETE).exists()
        assert (cache / name / "model.safetensors").read_text() == f"{name}/model.safetensors"
    assert all("already" in line for line in install(committed, cache))


def test_the_committed_start_models_record_the_start_their_runs_began_from():
    """start.json beside each committed build holds the start accuracies every committed run of
    claim (c) on it recorded (those runs all began from the committed builds)."""
    from jaxrlhf.experiments import records
    from jaxrlhf.experiments.claims import start_models as sm

    folders = records.runs(sm.COMMITTED.parent / "c")
    assert len(folders) >= 54
    for folder in folders:
        size = folder.parent.parent.name
        assert not sm.other_start(folder, size), folder
        recorded = json.loads((sm.committed_build(size) / sm.START).read_text())
        ran = json.loads(records.text(folder, "summary.json"))
        assert [ran[k] for k in sm.START_KEYS] == [recorded[k] for k in sm.START_KEYS]
    with pytest.raises(FileNotFoundError, match="bed-xl"):
        sm.committed_build("bed-xl")


def test_rerun_other_starts_reruns_only_the_runs_from_another_build(tmp_path, monkeypatch):
    """`--rerun-other-starts` runs the missing runs and those that began from another build of
    their model (here the start every run before 2026-12-06 recorded: the bed at 32.93% of test,
    37.48% of validation); a run from the committed build is kept."""
    from jaxrlhf.experiments.claims import __main__ as cli
    from jaxrlhf.experiments.claims.start_models import START, committed_build
    from jaxrlhf.experiments.runner import Runner

    out = (tmp_path / "claims").resolve()
    base = ["--claim", "c", "--seeds", "0", "--out", str(out), "--arms", "bed/*"]
    plan = claim("c").plan(cli.settings_of(cli.parse_args(base), "c"), out)
    committed = json.loads((committed_build("bed") / START).read_text())
    earlier = {"test_accuracy_start": 0.32932692766189575,
               "eval_accuracy_start": 0.37484118342399597}  # fmt: skip
    starts = {"bed/N1": committed, "bed/N16": earlier, "bed/N64": committed}
    for run in plan:  # the bed's three arms finished with the planned overrides
        if run.labels["arm"] in starts:
            write_run(run.folder, 0.6)
            summary = json.loads((run.folder / "summary.json").read_text())
            summary |= starts[run.labels["arm"]]
            (run.folder / "summary.json").write_text(json.dumps(summary))
            (run.folder / "experiment.json").write_text(json.dumps(run.overrides))
    monkeypatch.setattr(cli.start_models, "install", lambda: [])
    chosen: list[list[str]] = []

    def run_all(self, runs, last, on_progress=None):
        chosen.append([r.labels["arm"] for r in runs if self.needs_run(r)])

    monkeypatch.setattr(Runner, "run_all", run_all)
    for argv in (base, [*base, "--rerun-other-starts"]):
        cli.run_claim("c", cli.parse_args(argv))
    assert chosen == [[], ["bed/N16"]]


def test_the_arm_table_shows_the_policy_kl_beside_the_batch_kl(tmp_path):
    """Item 7 of the claims' issue: the sampler's batch KL (labelled so) and the final policy's
    KL from the start model on held-out prompts (summary.json policy_kl_end), mean ± s.e.; "-"
    for runs that did not measure it."""
    import json

    settings = Settings(seeds=(0, 1), steps=4, eval_every=2)
    runs = claim("a").plan(settings, tmp_path)
    for run in runs:
        write_run(run.folder, 0.6, kl=0.0)
        if run.labels["arm"] == "sync":
            summary = json.loads((run.folder / "summary.json").read_text())
            summary["policy_kl_end"] = 0.2 + 0.1 * run.labels["seed"]
            (run.folder / "summary.json").write_text(json.dumps(summary))
    record = analyse("a", runs, settings)
    rows = {r["arm"]: r for r in record["rows"]}
    assert rows["sync"]["policy_kl"] == pytest.approx(0.25)
    table = markdown(record)
    assert "| batch KL | policy KL |" in table
    sync_line = next(line for line in table.splitlines() if line.startswith("| sync |"))
    assert "| 0.00 ± 0.00 | 0.250 ± 0.050 |" in sync_line
    other = next(line for line in table.splitlines() if line.startswith("| one-step-off |"))
    assert "| 0.00 ± 0.00 | - |" in other


def test_the_time_table_gives_each_arm_s_seconds_per_update_after_the_first_two(tmp_path):
    """Where the time goes (descriptive): means over updates 3+ of each run, then over seeds;
    no table for records without the timing keys."""
    settings = Settings(seeds=(0, 1), steps=4, eval_every=2)
    runs = claim("a").plan(settings, tmp_path)
    for run in runs:
        write_run(run.folder, 0.6)
        seed = run.labels["seed"]
        path = run.folder / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for r in records:  # updates 1-2 (compilation) far off, so that counting them shows
            early = r["step"] <= 2
            r.update(step_s=9.0 if early else 0.5 + 0.1 * r["step"] + seed,
                     wait_for_generation_s=0.25, train_s=0.125, weight_sync_s=0.0625,
                     generation_tokens_per_s=1000.0 * (seed + 1),
                     generator_occupancy=0.5)  # fmt: skip
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "Where the time goes" not in markdown(analyse("a", [], settings))
    table = markdown(analyse("a", runs, settings))
    line = next(x for x in table.splitlines() if x.startswith("| sync | 9.0 |"))
    # seed 0: steps 3, 4 -> 0.8, 0.9 (mean 0.85); seed 1: 1.85; over seeds 1.35.
    assert line == "| sync | 9.0 | 1.350 | 0.250 | 0.125 | 0.062 | 1500 | 0.50 |"
