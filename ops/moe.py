"""Rules of the moe op family: Mixture-of-Experts routing: token dispatch to experts and combine."""
