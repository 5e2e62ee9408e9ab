"""The round driver and the one run lifecycle: build a run (:mod:`.setup`), drive its rounds
(:mod:`.engine`, :mod:`.runner`), keep it in its folder from start to finish or failure
(:mod:`.session`, :mod:`.checkpoint`). Above the methods it drives; :mod:`fedslice.api` and
Flower's ServerApp use it."""
