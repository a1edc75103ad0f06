"""Running summaries: the book of summary steps, the summarizer that writes them, its settings."""
