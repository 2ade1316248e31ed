"""`deltalens study`: the paper's question on one model and task, with statistics that carry a verdict:
`config` (StudyConfig, torch-free) and `run` (training, measurements, claims, report)."""
