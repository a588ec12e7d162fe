"""Services below every command: the spec reader and writer (:mod:`.loader`, :mod:`.block_yaml`),
the sharding-plan file (:mod:`.plan_file`), atomic output files (:mod:`.output`), progress
lines (:mod:`.progress`) and the one grammar for sizes (:mod:`.sizes`).

These import the core only.
"""
