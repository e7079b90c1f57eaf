"""Upper bound of any stop rule (issue 17, README here) on a collection pass's steps at its largest k: an
oracle that drafts exactly the m <= the step's accepted run of highest tokens / cost (m = 0: a plain step),
with no wasted stop pass, under the pass's measured step costs. Prints oracle / k = 0 per parquet."""
import sys

import numpy as np
import pandas as pd

from autotune.estimator import stop

for path in sys.argv[1:]:
    rows = pd.read_parquet(path)
    costs = stop.width_costs(rows)
    draft, verify = costs["draft"], costs["verify"]
    widest = rows[rows["k"] == rows["k"].max()].reset_index(drop=True)
    _, _, accepted, _ = stop.step_arrays(widest, "entropy", int(widest["k"].max()))
    tokens = cost = 0.0
    for run in accepted:
        m = max(range(int(run) + 1), key=lambda m: (m + 1) / (m * draft + verify[m + 1]) if m else 1.0)
        tokens, cost = tokens + m + 1, cost + (m * draft + verify[m + 1] if m else 1.0)
    print(path, "oracle / k=0:", round(tokens / cost, 4), "steps", len(accepted),
          "share of steps with >= 1 accepted", round(float(np.mean(accepted >= 1)), 3))
