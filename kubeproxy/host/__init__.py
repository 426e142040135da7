"""Host plumbing: Linux and HTTP machinery with no Service semantics."""
