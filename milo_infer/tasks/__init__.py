"""What a task is: demonstrations, templates and labels, the benchmark loaders, scoring, the shipped corpus."""
