"""One module per schedule family; each returns a Schedule of per-rank op lists."""
