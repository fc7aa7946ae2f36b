"""The parallel layout (pure), the process groups and collectives, and context parallelism.

`layout` is arithmetic on tp x cp x dp; `groups` is the only module that creates or looks up
process groups; `collectives` runs operations on the groups it is handed; `cp/` is the zigzag
index math, the one place CP is applied to a batch, and verl's formulas as references.
"""
