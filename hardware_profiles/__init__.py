"""hardware_profiles: what a cluster is made of (devices, links, measured curves), as a frozen `Cluster`.

Loaded from YAML or a bundled preset (presets/), or written by `plan profile` from measurements. Imports nothing
else of shardwise.
"""
from hardware_profiles.profile_dict import cluster_from_dict, cluster_to_dict
from hardware_profiles.schema import Cluster, CollectiveCurve, DeviceSpec, LinkSpec, ProfileError
from hardware_profiles.load import list_presets, load_cluster, save_cluster

__all__ = ["Cluster", "CollectiveCurve", "DeviceSpec", "LinkSpec", "ProfileError", "cluster_from_dict",
           "cluster_to_dict", "list_presets", "load_cluster", "save_cluster"]
