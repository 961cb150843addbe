"""The chain of sources a request walks: each answers, falls through with a reason, or ends it."""
