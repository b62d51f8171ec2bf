// Package cni is weft's CNI plugin, weft-cni: it attaches each pod to the
// node's bridge with an address that the local weft router hands out over its
// local API (package api), so the plugin's config names only the socket.
//
// The commands run on containernetworking/cni's skel: ADD, DEL, CHECK, STATUS,
// GC and VERSION. This file and the other portable files hold the config
// parsing, naming, error mapping and result building; plugin_linux.go holds
// the netlink side.
package cni

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/weft-net/weft/api"
)

// specVersions are the CNI spec versions weft-cni speaks.
var specVersions = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// SupportedVersions is what VERSION reports.
func SupportedVersions() version.PluginInfo { return version.PluginSupports(specVersions...) }

// maxSocketPath is the longest path a unix socket address can hold (sun_path
// is 108 bytes including the terminating NUL).
const maxSocketPath = 107

// NetConf is the network config weft-cni reads on stdin, e.g.
//
//	{"cniVersion":"1.0.0","name":"weft","type":"weft-cni","socket":"/run/weft/weft.sock"}
//
// Unknown fields are ignored, as CNI plugins do.
type NetConf struct {
	types.NetConf

	// Socket is the weft router's local API socket; api.DefaultSocket when empty.
	Socket string `json:"socket,omitempty"`
	// LogFile, when set, is a file the plugin appends a debug log to. Off by default.
	LogFile string `json:"logFile,omitempty"`
	// LogLevel is the level of LogFile: debug, info (the default), warn or error.
	LogLevel string `json:"logLevel,omitempty"`

	level slog.Level
}

// Level is the parsed LogLevel.
func (c *NetConf) Level() slog.Level { return c.level }

// ParseConfig decodes and validates the network config from stdin, fills in
// defaults and parses a prevResult if there is one. Every error is a
// *types.Error whose message names the field and what to do.
func ParseConfig(stdin []byte) (*NetConf, error) {
	if len(strings.TrimSpace(string(stdin))) == 0 {
		return nil, types.NewError(types.ErrDecodingFailure, "network config on stdin is empty: the runtime must pass the weft network config", "")
	}
	conf := &NetConf{}
	if err := json.Unmarshal(stdin, conf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("network config on stdin is not valid JSON for weft-cni: %v", err), "")
	}
	if conf.Name == "" {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, `network config has no "name": set it to the network's name, e.g. "weft"`, "")
	}
	if !slices.Contains(specVersions, conf.CNIVersion) {
		return nil, types.NewError(types.ErrIncompatibleCNIVersion,
			fmt.Sprintf("network config has cniVersion %q; weft-cni supports %s", conf.CNIVersion, strings.Join(specVersions, ", ")), "")
	}
	if conf.IPAM.Type != "" {
		return nil, types.NewError(types.ErrInvalidNetworkConfig,
			fmt.Sprintf(`network config has an "ipam" section (type %q), but weft-cni takes addresses from the weft router: remove it`, conf.IPAM.Type), "")
	}
	if conf.Socket == "" {
		conf.Socket = api.DefaultSocket
	}
	if err := checkPath("socket", conf.Socket); err != nil {
		return nil, err
	}
	if len(conf.Socket) > maxSocketPath {
		return nil, types.NewError(types.ErrInvalidNetworkConfig,
			fmt.Sprintf(`network config "socket" is %d bytes long; a unix socket path holds at most %d`, len(conf.Socket), maxSocketPath), "")
	}
	if conf.LogFile != "" {
		if err := checkPath("logFile", conf.LogFile); err != nil {
			return nil, err
		}
	}
	conf.level = slog.LevelInfo
	if conf.LogLevel != "" {
		if err := conf.level.UnmarshalText([]byte(conf.LogLevel)); err != nil {
			return nil, types.NewError(types.ErrInvalidNetworkConfig,
				fmt.Sprintf(`network config "logLevel" is %q; use debug, info, warn or error`, conf.LogLevel), "")
		}
	}
	if conf.RawPrevResult != nil {
		if err := version.ParsePrevResult(&conf.NetConf); err != nil {
			return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf(`network config "prevResult" is not a valid CNI %s result: %v`, conf.CNIVersion, err), "")
		}
	}
	return conf, nil
}

// checkPath requires an absolute, clean path without NUL bytes.
func checkPath(field, p string) error {
	switch {
	case strings.ContainsRune(p, 0):
		return types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf("network config %q contains a NUL byte", field), "")
	case !filepath.IsAbs(p):
		return types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf("network config %q is %q: it must be an absolute path", field, p), "")
	}
	return nil
}

// podArgs are the CNI_ARGS weft-cni reads; the runtime passes others too.
type podArgs struct {
	types.CommonArgs
	K8S_POD_NAMESPACE types.UnmarshallableString
	K8S_POD_NAME      types.UnmarshallableString
}

// parsePodArgs reads the pod's namespace and name from CNI_ARGS
// ("K=V;K2=V2"), ignoring other keys. Both are empty outside Kubernetes.
func parsePodArgs(s string) (namespace, name string, err error) {
	a := podArgs{CommonArgs: types.CommonArgs{IgnoreUnknown: true}}
	if err := types.LoadArgs(s, &a); err != nil {
		return "", "", types.NewError(types.ErrInvalidEnvironmentVariables,
			fmt.Sprintf("CNI_ARGS %q is not a list of KEY=VALUE pairs separated by ';': %v", s, err), "")
	}
	return string(a.K8S_POD_NAMESPACE), string(a.K8S_POD_NAME), nil
}

// attachment validates the container id and interface name of a command.
func attachment(containerID, ifName string) (api.Attachment, error) {
	att := api.Attachment{ContainerID: containerID, IfName: ifName}
	if err := att.Validate(); err != nil {
		return att, types.NewError(types.ErrInvalidEnvironmentVariables, err.Error(), "")
	}
	return att, nil
}

// validAttachments turns the GC config's cni.dev/valid-attachments into API
// attachments, refusing malformed entries so that GC never releases an
// address because an entry was garbled.
func validAttachments(conf *NetConf) ([]api.Attachment, error) {
	out := make([]api.Attachment, 0, len(conf.ValidAttachments))
	for i, v := range conf.ValidAttachments {
		att := api.Attachment{ContainerID: v.ContainerID, IfName: v.IfName}
		if err := att.Validate(); err != nil {
			return nil, types.NewError(types.ErrInvalidNetworkConfig,
				fmt.Sprintf(`network config "cni.dev/valid-attachments" entry %d: %v`, i, err), "")
		}
		out = append(out, att)
	}
	return out, nil
}
