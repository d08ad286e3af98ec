"""pdserve engine package."""
