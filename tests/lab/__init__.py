"""The chaos lab: hosts in network namespaces reached over real SSH, a seeded fault schedule, a verdict.

    python scripts/chaos.py --seed 7 --faults 50          # a soak (~15 min); `--help` for every option
    python scripts/chaos.py --cleanup                     # remove leftovers (zbc* namespaces, links, dirs)

Modules: net (namespaces, bridge, nftables), hosts (an sshd per namespace, ssh_config, known_hosts, the profile),
schedule (the seeded fault plan, pure), verdict (what the telemetry says: lost steps, checksums, stalls; pure),
timeline (the PNG), lab (the run itself). docs/reliability.md describes what is measured and the last soak.
"""
