"""Rules of the index op family: gather, gather_nd, index_select, scatter, scatter_add, index_put, index_copy, masked_fill, masked_scatter, where, one_hot, isin."""
