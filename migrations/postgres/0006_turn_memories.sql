-- The memories layer each turn's prompt showed (the memory graph's neighbourhood of its
-- message, as rendered), on the turn's message row: replay rebuilds a lost prompt exactly with
-- the memory graph on too (a recall now would find another neighbourhood). NULL: not logged
-- (the graph was off, or the row predates this column); '' : nothing was recalled.
ALTER TABLE turns ADD COLUMN memories TEXT;
