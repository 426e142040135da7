"""The feature gates the upstream kube-proxy 1.37 binary knows: name, stage, default, lock.

Upstream's ``--feature-gates`` (and ``featureGates`` in the configuration file) accepts
every gate registered in Kubernetes' shared feature gate, not only kube-proxy's own: the
kube-proxy binary registers ``pkg/features/kube_features.go``
(``defaultVersionedKubernetesFeatureGates``, with the apiserver, client-go, component-base
logging and zpages gates it relists), so a configuration naming a kubelet or scheduler
gate is accepted by kube-proxy and must be accepted here too. This table is that list at
Kubernetes 1.37, one gate per line: ``Name stage default [locked]``.

Sources (read with the ``search`` tool; the 1.37 ``kube_features.go`` itself could not be
read whole, so its content was assembled from what documents it):

* kubernetes.io, "Feature Gates" reference, section "Feature gates in Kubernetes v1.37"
  (``/docs/reference/command-line-tools-reference/feature-gates/``): every gate's stage
  and default at 1.37 (both tables, "Alpha or Beta" and "Graduated or Deprecated");
* kubernetes/kubernetes#139397 (``KubeProxyIPVS`` added to ``pkg/features/kube_features.go``)
  and kubernetes/website#56172 (``KubeProxyIPVS``: stage deprecated, default true, from
  1.37; to default to false in 1.40 and lock in 1.43, KEP-5495);
* KEP-6032 and the website's ``KubeProxyNFTablesLocalhostNodePorts`` page (alpha, default
  false, from 1.37);
* kubernetes/kubernetes#137536 (``NFTablesNetlink``, beta, on by default in 1.37), which
  the website's table of that snapshot does not list yet; likewise the other 1.37 gates
  the release's notes name but that table lacks (``EXTRA_137`` below);
* ``LockToDefault``, which the website does not show: upstream's generated lists under
  ``test/compatibility_lifecycle/reference/`` (the markdown feature list and
  ``versioned_feature_list.yaml``, 1.36 development) and the 1.37 release notes ("GA,
  locked"). Upstream locks a gate when it reaches GA, with the few exceptions listed in
  ``UNLOCKED_GA``; deprecated gates are not locked except those in ``LOCKED_DEPRECATED``.

``AllAlpha`` and ``AllBeta`` are component-base's special gates (see
:mod:`kubeproxy.featuregates`).
"""

from __future__ import annotations

from typing import Final

__all__ = ["EXTRA_137", "GATES_137", "LOCKED_DEPRECATED", "OWN_GATES", "UNLOCKED_GA"]

# Alpha and beta gates at 1.37 (website, "Feature gates for Alpha or Beta features").
_ALPHA_BETA: Final = """
AllowParsingUserUIDFromCertAuth beta true
AllowUnsafeMalformedObjectDeletion beta true
APIResponseCompression beta true
APIServerIdentity beta true
APIServerWebhookAuthenticationToken alpha false
APIServingWithRoutine alpha false
AtomicFIFO beta true
AtomicWriteVolumeUserFields alpha false
AuthorizePodWebsocketUpgradeCreatePermission beta true
CBORServingAndStorage alpha false
ClearingNominatedNodeNameAfterBinding beta true
CloudControllerManagerWatchBasedRoutesReconciliation alpha false
CloudControllerManagerWebhook alpha false
ComponentFlagz beta true
ComponentStatusz beta true
CompositePodGroup alpha false
ConcurrentWatchObjectDecode beta true
ConstrainedImpersonation beta true
ContainerCheckpoint beta true
ContainerRestartRules beta true
ContainerStopSignals alpha false
ContextualLogging beta true
ControllerManagerReleaseLeaderElectionLockOnExit alpha false
CoordinatedLeaderElection beta false
CPUManagerPolicyAlphaOptions alpha false
CPUManagerPolicyBetaOptions beta true
CRDObservedGenerationTracking beta false
CRIListStreaming alpha false
CrossNamespaceVolumeDataSource alpha false
CSIVolumeHealth alpha false
CustomCPUCFSQuotaPeriod alpha false
DeclarativeValidationBeta beta true
DefaultPodSysctls alpha false
DeploymentReplicaSetTerminatingReplicas beta true
DetectCacheInconsistency beta true
DisableCPUQuotaWithExclusiveCPUs beta true
DRAConsumableCapacity beta true
DRADerivedAttributes alpha false
DRADeviceBindingConditions beta true
DRADeviceCompatibilityGroups alpha false
DRAListTypeAttributes alpha false
DRANodeAllocatableResources alpha false
DRAOptionalNodeOperations alpha false
DRAPartitionableDevices beta true
DRAPartitionableDevicesType alpha false
DRAResourceClaimGranularStatusAuthorization beta true
DRAResourcePoolStatus alpha false
DRASchedulerFilterTimeout alpha false
DRAWorkloadResourceClaims beta false
EmptyDirVolumeMode alpha false
EnvFiles beta true
EtcdRangeStream beta true
EventedPLEG alpha false
ExcludeAdmissionWebhookVirtualResources beta true
ExtendWebSocketsToKubelet beta true
GenericWorkload beta false
GracefulNodeShutdown beta true
GracefulNodeShutdownBasedOnPodPriority beta true
GRPCContainerProbeTLS alpha false
H2CContainerProbe alpha false
HPAScaleToZero beta true
HugepageAwareEviction beta true
ImageVolumeWithDigest alpha false
InOrderInformers beta true
InPlacePodLevelResourcesVerticalScaling beta true
InPlacePodVerticalScalingExclusiveCPUs alpha false
InPlacePodVerticalScalingExclusiveMemory alpha false
InPlacePodVerticalScalingMemoryBackedVolumes alpha false
InPlacePodVerticalScalingSchedulerPreemption alpha false
KubeletCrashLoopBackOffMax beta true
KubeletEnsureSecretPulledImages beta true
KubeletInUserNamespace beta true
KubeletSeparateDiskGC beta true
KubeletServiceAccountTokenForCredentialProviders beta true
KubeProxyNFTablesLocalhostNodePorts alpha false
ListFromCacheSnapshot beta true
LocalStorageCapacityIsolationFSQuotaMonitoring beta false
LoggingAlphaOptions alpha false
LoggingBetaOptions beta true
ManifestBasedAdmissionControlConfig beta true
MatchLabelKeysInPodTopologySpread beta true
MatchLabelKeysInPodTopologySpreadSelectorMerge beta true
MaxUnavailableStatefulSet beta true
MemoryQoS beta true
MutablePodResourcesForSuspendedJobs beta true
MutablePVNodeAffinity alpha false
MutableSchedulingDirectivesForSuspendedJobs beta true
NativeHistograms beta true
NodeLifecycleConditions alpha false
NominatedNodeNameForExpectation beta true
OpenAPIEnums beta true
OpportunisticBatching beta true
PersistentVolumeClaimUnusedSinceTime beta true
PodAndContainerStatsFromCRI beta false
PodDeletionCost beta true
PodGroupPreemptionPolicy alpha false
PodLevelResourceManagers beta false
PodLevelResources beta true
PodLogsQuerySplitStreams alpha false
PodsAPI beta true
PodTopologyLabelsAdmission beta true
PortForwardWebsockets beta true
PreventStaticPodAPIReferences beta true
QOSReserved alpha false
ReduceDefaultCrashLoopBackOffDecay alpha false
ReloadKubeletServerCertificateFile beta true
RemoteRequestHeaderUID alpha false
ResourceHealthStatus beta true
RestartAllContainersOnContainerExits beta true
RotateKubeletServerCertificate beta true
RuntimeClassInImageCriApi alpha false
SchedulerAsyncAPICalls beta true
SchedulerAsyncPreemption beta true
SchedulerPopFromBackoffQ beta true
ServiceAccountNodeAudienceRestriction beta true
ShardedListAndWatch alpha false
SizeBasedListCostEstimate beta true
StaleControllerConsistencyDaemonSet beta true
StaleControllerConsistencyJob beta true
StaleControllerConsistencyReplicaSet beta true
StaleControllerConsistencyStatefulSet beta true
StatefulSetRecreateStrategy alpha false
StorageCapacityScoring beta true
StorageVersionAPI alpha false
StorageVersionHash beta true
StorageVersionMigrator beta false
StrictIPCIDRValidation beta true
StructuredAuthenticationConfigurationEgressSelector beta true
StructuredAuthenticationConfigurationJWKSMetrics beta true
SupplementalGroupsPolicy beta true
SystemdWatchdog beta true
TaintTolerationComparisonOperators alpha false
TokenRequestServiceAccountUIDValidation beta true
TopologyAwareWorkloadScheduling alpha false
TopologyManagerPolicyAlphaOptions alpha false
TopologyManagerPolicyBetaOptions beta true
TranslateStreamCloseWebsocketRequests beta true
UnauthenticatedHTTP2DOSMitigation beta true
UnknownVersionInteroperabilityProxy beta true
UnlockWhileProcessingFIFO beta true
UserNamespacesHostNetworkSupport alpha false
VolumeBindMountOptions alpha false
VolumeLimitScaling beta true
WatchList beta true
WatchListClient beta true
WindowsCPUAndMemoryAffinity alpha false
WindowsGracefulNodeShutdown beta true
WorkloadWithJob alpha false
"""

# GA and deprecated gates at 1.37 (website, "Feature gates for graduated or deprecated
# features"); whether each is locked is decided by UNLOCKED_GA / LOCKED_DEPRECATED.
_GRADUATED: Final = """
AllowDNSOnlyNodeCSR deprecated false
AllowInsecureKubeletCertificateSigningRequests deprecated false
AnonymousAuthConfigurableEndpoints ga true
AnyVolumeDataSource ga true
APIServerTracing ga true
AuthorizeNodeWithSelectors ga true
AuthorizeWithSelectors ga true
BtreeWatchCache ga true
ChangeContainerStatusOnKubeletRestart deprecated false
ClusterTrustBundle ga true
ClusterTrustBundleProjection ga true
ConsistentListFromCache ga true
CPUManagerPolicyOptions ga true
CRDValidationRatcheting ga true
CronJobsScheduledAnnotation ga true
CSIServiceAccountTokenSecrets ga true
CustomResourceFieldSelectors ga true
DeclarativeValidation ga true
DeclarativeValidationTakeover deprecated false
DisableAllocatorDualWrite ga true
DisableNodeKubeProxyVersion deprecated true
DRAAdminAccess ga true
DRADeviceTaintRules ga true
DRADeviceTaints ga true
DRAExtendedResource ga true
DRAPrioritizedList ga true
DRAResourceClaimDeviceStatus ga true
DynamicResourceAllocation ga true
ElasticIndexedJob ga true
ExecProbeTimeout ga true
ExternalServiceAccountTokenSigner ga true
GitRepoVolumeDriver deprecated false
HostnameOverride ga true
HPAConfigurableTolerance ga true
ImageMaximumGCAge ga true
ImageVolume ga true
InformerResourceVersion ga true
InPlacePodVerticalScaling ga true
InPlacePodVerticalScalingAllocatedStatus deprecated false
JobBackoffLimitPerIndex ga true
JobManagedBy ga true
JobPodReplacementPolicy ga true
JobSuccessPolicy ga true
KMSv1 deprecated false
KubeletCgroupDriverFromCRI ga true
KubeletFineGrainedAuthz ga true
KubeletPodResourcesDynamicResources ga true
KubeletPodResourcesGet ga true
KubeletPSI ga true
KubeletTracing ga true
KubeProxyIPVS deprecated true
LogarithmicScaleDown ga true
MatchLabelKeysInPodAffinity ga true
MemoryManager ga true
MultiCIDRServiceAllocator ga true
MutableCSINodeAllocatableCount ga true
MutatingAdmissionPolicy ga true
NFTablesProxyMode ga true
NodeDeclaredFeatures ga true
NodeInclusionPolicyInPodTopologySpread ga true
NodeLogQuery ga true
NodeSwap ga true
OrderedNamespaceDeletion ga true
PodCertificateRequest ga true
PodIndexLabel ga true
PodLifecycleSleepAction ga true
PodLifecycleSleepActionAllowZero ga true
PodObservedGenerationTracking ga true
PodReadyToStartContainersCondition ga true
PodSchedulingReadiness ga true
PreferSameTrafficDistribution ga true
ProcMountType ga true
RecoverVolumeExpansionFailure ga true
RecursiveReadOnlyMounts ga true
RelaxedDNSSearchValidation ga true
RelaxedEnvironmentVariableValidation ga true
RelaxedServiceNameValidation ga true
ResilientWatchCacheInitialization ga true
RetryGenerateName ga true
SchedulerQueueingHints ga true
SELinuxChangePolicy ga true
SELinuxMount ga true
SELinuxMountReadWriteOncePod ga true
SeparateCacheWatchRPC deprecated false
SeparateTaintEvictionController ga true
ServiceAccountTokenJTI ga true
ServiceAccountTokenNodeBinding ga true
ServiceAccountTokenNodeBindingValidation ga true
ServiceAccountTokenPodNodeInfo ga true
ServiceTrafficDistribution ga true
SidecarContainers ga true
StatefulSetAutoDeletePVC ga true
StatefulSetStartOrdinal ga true
StorageNamespaceIndex deprecated true
StreamingCollectionEncodingToJSON ga true
StreamingCollectionEncodingToProtobuf ga true
StrictCostEnforcementForVAP ga true
StrictCostEnforcementForWebhooks ga true
StructuredAuthenticationConfiguration ga true
StructuredAuthorizationConfiguration ga true
TopologyAwareHints ga true
TopologyManagerPolicyOptions ga true
UserNamespacesSupport ga true
VolumeAttributesClass ga true
WatchCacheInitializationPostStartHook ga true
WatchFromStorageWithoutResourceVersion deprecated false
WindowsHostNetwork deprecated false
WinDSR ga true
WinOverlay ga true
"""

EXTRA_137: Final = """
NFTablesNetlink beta true
WatchListCompression beta true
ConsistentListFromCacheSkipTimeoutFallback alpha false
StaleControllerConsistencyHPA beta true
NodeControllerLeaseCircuitBreaker beta true
EvictionRequestAPI alpha false
SchedulerPreQueueingHints alpha false
InterPodAffinityHostnameFastPath alpha false
InPlacePodVerticalScalingInitContainers ga true
PLEGOnDemandRelist ga true
HPAOptimizedSelectorStore beta true
ClientsAllowCBOR alpha false
ClientsPreferCBOR alpha false
InOrderInformersBatchProcess beta true
AggregatedDiscoveryRemoveBetaType deprecated true
AllowOverwriteTerminationGracePeriodSeconds deprecated false
AllowServiceLBStatusOnNonLB deprecated false
"""
"""Gates of 1.37 the website's table lacks: ``NFTablesNetlink`` (kubernetes#137536) and
the other gates the 1.37 release notes name; client-go's gates and three deprecated,
locked gates from upstream's generated feature list that nothing says were removed."""

UNLOCKED_GA: Final = frozenset(
    {
        # upstream's generated feature list: GA without a lock.
        "InformerResourceVersion",
        # 1.37 release notes: GA, on by default, not (yet) locked.
        "ClusterTrustBundle",
        "ClusterTrustBundleProjection",
        "DRADeviceTaints",
        "MutatingAdmissionPolicy",
        "PodCertificateRequest",
        "SELinuxMount",
    }
)
"""GA gates upstream does not lock (every other GA gate is locked to its default)."""

LOCKED_DEPRECATED: Final = frozenset(
    {
        "AggregatedDiscoveryRemoveBetaType",
        "AllowOverwriteTerminationGracePeriodSeconds",
        "AllowServiceLBStatusOnNonLB",
    }
)
"""Deprecated gates upstream locks (upstream's generated feature lists)."""

GATES_137: Final = _ALPHA_BETA + _GRADUATED + EXTRA_137
"""The whole table, as text."""

OWN_GATES: Final = """
NFTablesOwnedTable beta true
"""
"""This project's own gates, which upstream's kube-proxy does not know (it would refuse
them as unrecognized): ``NFTablesOwnedTable``, nftables mode's owned table
(``kubeproxy.backends.nftables.owner``; beta, on by default: on kernels with the owner
and persist table flags, no other process can change, flush or delete our table)."""
