"""Debias study: compare the arms of a Hydra multirun on position fairness and on the Jacobian valley.

    python -m analysis.study outputs/in2/<sweep>                      # writes <sweep>/study/report.md
    python -m analysis.study outputs/in2/<sweep> --out study --reference none --seeds shared --score correct

A study is one `-m` sweep directory with one job directory per (arm, seed): `<sweep>/<n>/` holding
`.hydra/overrides.yaml` (the arm is the `debias=` override, `a+b` for `debias=[a,b]`, `none` without one;
the seed is `seed=`, 0 without one), `eval/in2_step0.json` and `eval/in2_step<N>.json` (the final step is
the largest N; any other N is a saved checkpoint scored by `scripts.eval_checkpoint`), `metrics.jsonl`, and
`finished.json`, which `train.py` writes last: a job without it was killed or is still running, and the study
names it and stops (`--skip-incomplete`: leave it out, named in the report) rather than take its last evaluation
for a final one. `python train.py -m <the sweep's command> resume_sweep=<sweep>` finishes such jobs.
Every job asks the same held-out IN2 questions (same data seed), so arms are compared paired by question id,
and seed k of every arm starts from the same initialisation and data order (`--seeds shared`, the default).
Every statistic comes from `analysis.stats` (docs/STATISTICS.md):

- fairness metrics of each arm's final scores (`fairness_estimates`; `--score FIELD` compares another outcome
  field than `correct`, e.g. a log-likelihood): mean, worst depth bin, best minus worst bin (gap), middle
  [0.25, 0.75) minus ends and their ratio, on each question's mean over the arm's seeds, and per seed;
- mean and middle minus ends, and each bin's mean: t intervals of the crossed design arms x seeds x questions,
  the seed part pooled over the arms (`stats.crossed_interval`), for each arm and its difference to the
  reference arm (default `none`);
- worst bin and gap: the difference with a paired permutation test's p-value (an extreme has no interval that
  covers), the flat-curve floor (`flat_curve`: both are extremes over bins, so a perfectly flat curve has a gap
  above 0), and the worst bin's minimum detectable effect by simulation (`stats.worst_bin_mde`);
- the Jacobian valley (`valley/<set>/peak_to_trough_log10`, `valley/<set>/middle_mass`) at the first and
  last logged step of each arm, mean over seeds;
- whether the per-step Jacobian metrics track the curve (`tracking`): Spearman's ρ over arms (the independent
  units) of the change in each valley metric and in the measured-λ rollout's fit (`rollout/<set>/measured/w1`,
  `.../spearman`) against the change in middle minus ends, with exact permutation p-values, Holm-adjusted.

Writes `<out>/report.md`, `<out>/study.json` (every number), `<out>/accuracy_by_depth.png`,
`<out>/valley_accuracy_scatter.png` and `<out>/answers/` (every job's per-question answers, for re-analysis).

The package follows those steps: `load` (the jobs), `fairness`, `valley`, `tracking`, `numbers` (`analyse`: every
number), `report` (tables, figures, verdict) and `cli` (`python -m analysis.study`).
"""
from analysis.study.cli import main  # noqa: F401 (the package's interface)
from analysis.study.fairness import fairness_estimates, flat_curve  # noqa: F401
from analysis.study.load import VALLEY_METRICS  # noqa: F401
from analysis.study.load import StudyError, arm_name, load_study, merged_metrics, seed_of  # noqa: F401
from analysis.study.numbers import analyse  # noqa: F401
from analysis.study.report import verdict_lines, write_report  # noqa: F401
from analysis.study.tracking import arm_correlation  # noqa: F401
from analysis.study.valley import valley_ends  # noqa: F401
