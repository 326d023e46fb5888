# vmmd in a container. Build: docker build -t vmmd .
# The daemon runs as the unprivileged user vmmd (uid 10001) in group vmmd (gid 2000), which is
# also the socket group: no capability is needed to give the sockets that group.
# Run (host backend): install -d -o 10001 -g 2000 -m 0750 /run/vmmd   # on the host, once
#                     docker run --rm -v /run/vmmd:/run/vmmd vmmd
# Run (GPU): add --gpus all. Clients in other containers mount the same /run/vmmd,
# set VMMD_SOCKET_DIR=/run/vmmd and run with group 2000 (docker run --group-add 2000).

FROM node:20-bookworm AS build
WORKDIR /app
# The whole tree (.dockerignore keeps node_modules, build output and .git out).
COPY . .
# npm ci builds the addon (node-gyp, no CUDA toolkit needed: libcuda is opened at run time)
# and the TypeScript (prepare); then only production dependencies stay.
RUN npm ci && npm prune --omit=dev

FROM node:20-bookworm-slim
ENV NODE_ENV=production NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN groupadd --system --gid 2000 vmmd \
 && useradd --system --uid 10001 --gid 2000 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin vmmd \
 && install -d -o 10001 -g 2000 -m 0750 /run/vmmd
WORKDIR /app
COPY --from=build /app/package.json ./
COPY --from=build /app/node_modules node_modules
COPY --from=build /app/build/Release/vmmd_native.node build/Release/vmmd_native.node
COPY --from=build /app/dist dist
COPY --from=build /app/proto proto
COPY --from=build /app/bin bin
VOLUME /run/vmmd
USER 10001:2000
EXPOSE 9464 9465
# Docker's health check runs a command: vmmctl health asks the health service without opening a session (nothing
# logged every 30 s); Kubernetes probes the --health-port instead (deploy/k8s).
HEALTHCHECK --interval=30s --timeout=5s CMD ["node", "bin/vmmctl.js", "--socket-dir", "/run/vmmd", "health"]
ENTRYPOINT ["node", "bin/vmmd.js", "--socket-dir", "/run/vmmd", "--socket-group", "2000"]
