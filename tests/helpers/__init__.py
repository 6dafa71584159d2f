"""What the tests share: polling with a deadline, metrics parsing, `tierserve up` plans, running
clusters, tiny models, fakes. Test files import from here, never from each other."""
