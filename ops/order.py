"""Rules of the order op family: topk, sort, argmax, argmin, cumsum, prod, maximum, minimum."""
