package router

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// ConfListName is the file the router writes into --cni-conf-dir.
const ConfListName = "10-weft.conflist"

// Plugins the router installs into --cni-bin-dir, from beside its own binary.
var cniPlugins = []string{"weft-cni", "portmap"}

// hostPlugins are the plugins a node needs that are not weft's own: the
// CRI calls loopback for every pod sandbox, and a node without Debian's
// kubernetes-cni package (or containernetworking-plugins) has none. They are
// installed when they are beside the weft binary (the image has them) and
// the node has none of its own: a node's own copy is left as it is.
var hostPlugins = []string{"loopback"}

// ConfList is the network configuration list the router writes. cniVersion
// stays at 1.0.0, which every runtime in use accepts (containerd 1.6's libcni
// knows nothing later); cniVersions offers 1.1.0 so that newer runtimes use
// STATUS and GC.
func ConfList(socket string) ([]byte, error) {
	conf := map[string]any{
		"cniVersion":  "1.0.0",
		"cniVersions": []string{"0.3.1", "0.4.0", "1.0.0", "1.1.0"},
		"name":        "weft",
		"plugins": []any{
			map[string]any{"type": "weft-cni", "socket": socket},
			// nftables, like weft's own rules: portmap then neither probes for
			// iptables (an exec per ADD) nor depends on its legacy/nft flavour.
			map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}, "snat": true, "backend": "nftables"},
		},
	}
	return json.MarshalIndent(conf, "", "  ")
}

// InstallPlugins copies weft-cni and portmap from srcDir (beside the weft
// binary) into binDir, each atomically (a runtime never runs a half-written
// plugin) and only when it differs. It returns the files it changed. The
// DaemonSet's init container runs it (weft install-cni), so that the
// plugins are in place before the router writes the conflist. The host
// plugins (loopback) are added only where the node has none.
func InstallPlugins(srcDir, binDir string) (changed []string, err error) {
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating the CNI binary directory %s: %w", binDir, err)
	}
	for _, p := range cniPlugins {
		src := filepath.Join(srcDir, p)
		data, err := os.ReadFile(src)
		if err != nil {
			return nil, fmt.Errorf("the CNI plugin %s should be beside the weft binary at %s: %w (run `make build`, or install the release tarball whole)", p, src, err)
		}
		ok, err := writeIfChanged(filepath.Join(binDir, p), data, 0o755)
		if err != nil {
			return nil, fmt.Errorf("installing %s into %s: %w", p, binDir, err)
		}
		if ok {
			changed = append(changed, filepath.Join(binDir, p))
		}
	}
	for _, p := range hostPlugins {
		dst := filepath.Join(binDir, p)
		if _, err := os.Stat(dst); err == nil {
			continue
		}
		data, err := os.ReadFile(filepath.Join(srcDir, p))
		if os.IsNotExist(err) {
			continue // an install without it (a plain `go build`): the node must have its own
		}
		if err != nil {
			return nil, fmt.Errorf("reading the CNI plugin %s beside the weft binary: %w", p, err)
		}
		if _, err := writeIfChanged(dst, data, 0o755); err != nil {
			return nil, fmt.Errorf("installing %s into %s: %w", p, binDir, err)
		}
		changed = append(changed, dst)
	}
	return changed, nil
}

// installCNI copies the plugins into binDir and then writes the conflist:
// a runtime that sees the conflist finds the plugins already in place.
func installCNI(srcDir, binDir, confDir, socket string) (changed []string, err error) {
	changed, err = InstallPlugins(srcDir, binDir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating --cni-conf-dir: %w", err)
	}
	conf, err := ConfList(socket)
	if err != nil {
		return nil, err
	}
	ok, err := writeIfChanged(filepath.Join(confDir, ConfListName), append(conf, '\n'), 0o644)
	if err != nil {
		return nil, fmt.Errorf("writing the CNI config into --cni-conf-dir: %w", err)
	}
	if ok {
		changed = append(changed, filepath.Join(confDir, ConfListName))
	}
	return changed, nil
}

// writeIfChanged atomically replaces path with data (temp file and rename in
// the same directory) unless it already holds exactly data.
func writeIfChanged(path string, data []byte, mode os.FileMode) (bool, error) {
	if f, err := os.Open(path); err == nil {
		old, err := io.ReadAll(io.LimitReader(f, int64(len(data))+1))
		f.Close()
		if err == nil && bytes.Equal(old, data) {
			return false, nil
		}
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return false, err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return false, err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return false, err
	}
	if err := tmp.Close(); err != nil {
		return false, err
	}
	return true, os.Rename(tmp.Name(), path)
}

// removeConfList removes the conflist from confDir, so that the runtime
// attaches no more pods through weft and the node turns NotReady. It says
// whether there was one; none is no error.
func removeConfList(confDir string) (removed bool, path string, err error) {
	path = filepath.Join(confDir, ConfListName)
	switch err := os.Remove(path); {
	case err == nil:
		return true, path, nil
	case errors.Is(err, os.ErrNotExist):
		return false, path, nil
	default:
		return false, path, fmt.Errorf("removing the CNI config %s: %w", path, err)
	}
}
