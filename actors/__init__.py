"""kvroute's actors: one actor a module, each with one ``run(task_status)`` entry point."""
