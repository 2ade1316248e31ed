"""Input/output: model specs (`spec`), model loading (`models`), weight files (`tensors` and one reader
per format), run directories (`runs`) and atomic writes (`atomic`). Nothing here trains or analyses."""
