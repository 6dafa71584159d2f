"""Context-parallel attention (``docs/cp.md``): a step's cached prefix, stored one page per owner
rank, is either gathered per layer into alternating buffers (``gather.py``) or attended where it
lies, each rank's partial result (``partial.py``) merged by log-sum-exp (``merge.py``); a long step's
new tokens are split between the ranks (``split.py``). ``runner.py`` chooses for each step: the one CP
collaborator a ``ModelRunner`` holds."""
