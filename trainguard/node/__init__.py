"""Sources about this machine, read without a job's help: /proc (`procfs`, the one place that names it), the
kernel log (`kmsg`), mounts and a statvfs that cannot hang (`mounts`), cgroup memory limits (`cgroup`), the
stacks of processes (`stacks`, py-spy), the PyTorch flight recorders of a job's ranks (`flight`), and the devices
sysfs lists (`sysfs`: PCI devices, InfiniBand ports), and users' names for display, each lookup bounded (`users`).

May import: trainguard.core.
"""
