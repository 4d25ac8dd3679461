"""`coldsnap bench`: measured comparisons, written as JSON + PNG with the command that made them."""
