"""Admin reports: queries over history and their rendering."""
