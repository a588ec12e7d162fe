"""The planner: choosing layouts for a whole graph (:mod:`.solver`, an integer linear program).

It builds on the passes and imports no command and no engine.
"""
