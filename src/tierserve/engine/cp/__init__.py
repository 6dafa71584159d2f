"""Context-parallel attention (``docs/cp.md``): a step's cached prefix, stored one page per owner
rank, is either gathered per layer into alternating buffers (``gather.py``) or attended where it
lies, each rank's partial result (``partial.py``) merged by log-sum-exp (``merge.py``). ``runner.py``
chooses between them for each step: the one CP collaborator a ``ModelRunner`` holds."""
