"""One module per parallel dimension: groups (the grid), comm (every collective), tensor, pipeline, data."""
