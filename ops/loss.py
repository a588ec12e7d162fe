"""Rules of the loss op family: cross_entropy, dropout, multinomial (random ops draw from a counter-based generator)."""
