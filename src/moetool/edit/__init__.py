"""Edit an MoE after it is built: list, add, remove, prune and extract experts, then recalibrate the routers.

Every edit is a weight-free plan (:mod:`.plan`) over the folder's expert layout (:mod:`.layout`, from the output
architecture records), written one tensor at a time into a temporary folder moved into place when complete
(:mod:`.execute`). Edits that need the model's behaviour (the added expert's router row, pruning scores, router
recalibration) run it on text first (:mod:`.add`, :mod:`.scoring`, :mod:`.tune`).
"""
