package e2e

import "github.com/weft-net/weft/internal/nscluster"

// The namespace-cluster harness under the names the tests use (see doc.go).
type (
	Cluster     = nscluster.Cluster
	ClusterOpts = nscluster.ClusterOpts
	DemoOptions = nscluster.DemoOptions
	NSExec      = nscluster.NSExec
	Netns       = nscluster.Netns
	Node        = nscluster.Node
	Options     = nscluster.Options
	Pod         = nscluster.Pod
	Proc        = nscluster.Proc
	Router      = nscluster.Router
	Run         = nscluster.Run
	TB          = nscluster.TB
)

var (
	Demo        = nscluster.Demo
	NewRun      = nscluster.NewRun
	NewTestRun  = nscluster.NewTestRun
	Ping        = nscluster.Ping
	PingFrom    = nscluster.PingFrom
	PingMatrix  = nscluster.PingMatrix
	RaceReport  = nscluster.RaceReport
	RefConfList = nscluster.RefConfList
	Sweep       = nscluster.Sweep
	WaitUntil   = nscluster.WaitUntil

	UnderlayGateway = nscluster.UnderlayGateway
	UnderlaySubnet  = nscluster.UnderlaySubnet
)

const (
	ConfListFile = nscluster.ConfListFile
	MaxDemoNodes = nscluster.MaxDemoNodes
	PodIfName    = nscluster.PodIfName
	RefPluginDir = nscluster.RefPluginDir
	StatusAddr   = nscluster.StatusAddr

	routerBridge   = nscluster.RouterBridge
	underlayBridge = nscluster.UnderlayBridge
)
