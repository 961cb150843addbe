"""Transport ports and adapters: how actors reach remote services."""
