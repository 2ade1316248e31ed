"""What changed, and does it matter: weight deltas (`delta`), sparsification with re-evaluation
(`sparsify`), ES population diversity (`diversity`), and the analysis.json document a report is built
from (`document`, `report`)."""
